#!/usr/bin/env bash
# SkyRL on arctic-rl, on a CPU: a tiny Qwen2 made on the spot, 16 GSM8K problems from
# ../shared/data/gsm8k, GRPO for $STEPS steps (default 3). A stock SkyRL command plus the toggle, through
# recipes.skyrl_main so the gsm8k_recipe environment (recipes.gsm8k.reward) scores the rollouts.
#
#   bash integrations/arctic_rl_skyrl/install_env.sh      # once: the Python 3.12 environment
#   bash recipes/gsm8k/skyrl/run_cpu_smoke.sh [more SkyRL overrides ...]
#
# OUT_DIR (default /tmp/arctic-rl-skyrl-smoke) receives the model, data, TensorBoard logs
# (tensorboard/) and exports/arctic_rl_status.json (what the arctic server served).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv-skyrl/bin/python}"
out="${OUT_DIR:-/tmp/arctic-rl-skyrl-smoke}"
steps="${STEPS:-3}"

"$python" -m arctic_rl_core.models.tiny "$out/model" --family qwen2
"$python" -m recipes.gsm8k.skyrl.data --out "$out/data" --source local --limit 16

source recipes/common/skyrl_cpu_smoke.sh
skyrl_cpu_smoke "$python" "$out" "$steps" \
    data.train_data="['$out/data/train.parquet']" \
    data.val_data="['$out/data/test.parquet']" \
    trainer.policy.optimizer_config.lr=1e-5 \
    trainer.train_batch_size=4 \
    trainer.policy_mini_batch_size=4 \
    trainer.micro_train_batch_size_per_gpu=16 \
    trainer.micro_forward_batch_size_per_gpu=16 \
    generator.n_samples_per_prompt=4 \
    generator.batched=true \
    generator.sampling_params.max_generate_length=16 \
    trainer.max_prompt_length=512 \
    environment.env_class=gsm8k_recipe \
    trainer.override_entrypoint=recipes.skyrl_main \
    trainer.arctic_rl="{device: cpu, ray_auto_attach: false}" \
    "$@"
