#!/usr/bin/env bash
# Txt2SQL with SkyRL on arctic-rl, on a CPU: a tiny Qwen2 made on the spot, 2 questions on synthetic SQLite
# databases, GRPO for $STEPS steps (default 2) of 1 prompt x 2 samples, scored by recipes.txt2sql.reward
# in the txt2sql skyrl-gym environment (recipes/skyrl_env.py); no reference model. A stock SkyRL command
# plus the toggle. A random tiny model never writes <sql>, so every reward and advantage is 0: the
# entropy bonus gives the update a real gradient.
#
#   bash integrations/arctic_rl_skyrl/install_env.sh      # once: the Python 3.12 environment
#   bash recipes/txt2sql/skyrl/run_cpu_smoke.sh [more SkyRL overrides ...]
#
# OUT_DIR (default: a fresh temporary directory) receives the model, data, TensorBoard logs
# (tensorboard/) and exports/arctic_rl_status.json (what the arctic server served).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv-skyrl/bin/python}"
out="${OUT_DIR:-$(mktemp -d -t arctic-rl-skyrl-txt2sql-XXXXXX)}"
steps="${STEPS:-2}"

"$python" -m arctic_rl_core.models.tiny "$out/model" --family qwen2
"$python" -m recipes.txt2sql.data --out "$out/sql" --source synthetic --limit 2
"$python" -m recipes.skyrl_data --src "$out/sql" --out "$out/data" --env-class txt2sql --splits train dev

source recipes/common/skyrl_cpu_smoke.sh
skyrl_cpu_smoke "$python" "$out" "$steps" \
    data.train_data="['$out/data/train.parquet']" \
    data.val_data="['$out/data/dev.parquet']" \
    environment.env_class=txt2sql \
    trainer.policy.optimizer_config.lr=1e-4 \
    trainer.train_batch_size=1 \
    trainer.policy_mini_batch_size=1 \
    trainer.micro_train_batch_size_per_gpu=2 \
    trainer.micro_forward_batch_size_per_gpu=2 \
    generator.n_samples_per_prompt=2 \
    generator.batched=false \
    generator.chat_template_kwargs="{enable_thinking: false}" \
    generator.sampling_params.max_generate_length=8 \
    trainer.max_prompt_length=512 \
    trainer.algorithm.use_kl_loss=false \
    trainer.algorithm.use_entropy_loss=true \
    trainer.override_entrypoint=recipes.skyrl_main \
    trainer.arctic_rl="{device: cpu, ray_auto_attach: false, zorro_train: true, sampler_config: {max_num_seqs: 2}}" \
    "$@"
