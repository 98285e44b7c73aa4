#!/usr/bin/env bash
# SkyRL GRPO on GSM8K with arctic-rl as the backend: Qwen2.5-1.5B-Instruct on one node of $NUM_GPUS GPUs
# (default 4), training, sampling and the KL reference colocated. The overrides above the toggle are
# SkyRL's own GSM8K recipe; the last two lines switch it to arctic-rl. Rewards come from
# recipes.gsm8k.reward (as on verl and TRL) in the gsm8k_recipe skyrl-gym environment that
# recipes.skyrl_main registers (recipes/skyrl_env.py), not skyrl-gym's own gsm8k string match.
#
#   bash integrations/arctic_rl_skyrl/install_env.sh           # once: the Python 3.12 environment
#   bash recipes/gsm8k/skyrl/run_gpu.sh [more SkyRL overrides ...]
#
# DATA_DIR (default ~/data/gsm8k-skyrl) is filled from the Hugging Face hub on the first run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv-skyrl/bin/python}"
data="${DATA_DIR:-$HOME/data/gsm8k-skyrl}"
gpus="${NUM_GPUS:-4}"
model="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"

[[ -f "$data/train.parquet" ]] || "$python" -m recipes.gsm8k.skyrl.data --out "$data"

"$python" -m skyrl.train.entrypoints.main_base \
    data.train_data="['$data/train.parquet']" \
    data.val_data="['$data/test.parquet']" \
    trainer.policy.model.path="$model" \
    trainer.placement.colocate_all=true \
    trainer.placement.policy_num_gpus_per_node="$gpus" \
    generator.inference_engine.num_engines="$gpus" \
    generator.inference_engine.tensor_parallel_size=1 \
    trainer.epochs=20 \
    trainer.eval_batch_size=1024 \
    trainer.eval_before_train=true \
    trainer.eval_interval=5 \
    trainer.update_epochs_per_batch=1 \
    trainer.train_batch_size=1024 \
    trainer.policy_mini_batch_size=256 \
    trainer.micro_forward_batch_size_per_gpu=64 \
    trainer.micro_train_batch_size_per_gpu=64 \
    trainer.ckpt_interval=10 \
    trainer.max_prompt_length=512 \
    generator.sampling_params.max_generate_length=1024 \
    trainer.policy.optimizer_config.lr=1.0e-6 \
    trainer.algorithm.use_kl_loss=true \
    generator.n_samples_per_prompt=5 \
    generator.batched=true \
    environment.env_class=gsm8k_recipe \
    trainer.logger="${LOGGER:-console}" \
    trainer.project_name=gsm8k \
    trainer.run_name=gsm8k_arctic_rl \
    trainer.ckpt_path="$HOME/ckpts/gsm8k_arctic_rl" \
    trainer.override_entrypoint=recipes.skyrl_main \
    trainer.arctic_rl="{zorro_train: true, zorro_inference: true}" \
    "$@"
