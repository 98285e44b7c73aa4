#!/usr/bin/env bash
# Long-context QA with SkyRL on arctic-rl, on a CPU: a tiny Qwen2 made on the spot, 2 synthetic contexts of
# 1K tokens with 2 questions each, GRPO for $STEPS steps (default 2) of 2 prompts x 2 samples with ZoRRo
# Train, scored by recipes.long_context_qa.reward in the long_context_qa skyrl-gym environment
# (recipes/skyrl_env.py); no reference model. A stock SkyRL command plus the toggle. A random tiny model
# never writes <answer>, so every reward and advantage is 0: the entropy bonus gives the update a real
# gradient.
#
#   bash integrations/arctic_rl_skyrl/install_env.sh      # once: the Python 3.12 environment
#   bash recipes/long_context_qa/skyrl/run_cpu_smoke.sh [more SkyRL overrides ...]
#
# OUT_DIR (default: a fresh temporary directory) receives the model, data, TensorBoard logs
# (tensorboard/) and exports/arctic_rl_status.json (what the arctic server served).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv-skyrl/bin/python}"
out="${OUT_DIR:-$(mktemp -d -t arctic-rl-skyrl-lcqa-XXXXXX)}"
steps="${STEPS:-2}"

"$python" -m arctic_rl_core.models.tiny "$out/model" --family qwen2
"$python" -m recipes.long_context_qa.data --out "$out/lcqa" --dataset synthetic --tokenizer "$out/model" \
    --context-tokens 1024 --contexts 2 --test-contexts 1 --questions-per-context 2
"$python" -m recipes.skyrl_data --src "$out/lcqa" --out "$out/data" --env-class long_context_qa

source recipes/common/skyrl_cpu_smoke.sh
skyrl_cpu_smoke "$python" "$out" "$steps" \
    data.train_data="['$out/data/train.parquet']" \
    data.val_data="['$out/data/test.parquet']" \
    environment.env_class=long_context_qa \
    trainer.policy.optimizer_config.lr=1e-4 \
    trainer.train_batch_size=2 \
    trainer.policy_mini_batch_size=2 \
    trainer.micro_train_batch_size_per_gpu=4 \
    trainer.micro_forward_batch_size_per_gpu=4 \
    generator.n_samples_per_prompt=2 \
    generator.batched=false \
    generator.chat_template_kwargs="{enable_thinking: false}" \
    generator.sampling_params.max_generate_length=8 \
    trainer.max_prompt_length=1152 \
    trainer.algorithm.use_kl_loss=false \
    trainer.algorithm.use_entropy_loss=true \
    trainer.override_entrypoint=recipes.skyrl_main \
    trainer.arctic_rl="{device: cpu, ray_auto_attach: false, zorro_train: true, sampler_config: {max_num_seqs: 4}}" \
    "$@"
