#!/usr/bin/env bash
# SkyRL GRPO on long-context QA with arctic-rl as the backend: Qwen3-8B on HotpotQA (distractor setting),
# one node of $NUM_GPUS GPUs (default 8, 80 GB or more each), training, sampling and the KL reference
# colocated, ZoRRo on. Rewards come from recipes.long_context_qa.reward in the long_context_qa
# skyrl-gym environment (recipes/skyrl_env.py).
#
#   bash integrations/arctic_rl_skyrl/install_env.sh            # once: the Python 3.12 environment
#   bash recipes/long_context_qa/skyrl/run_gpu.sh [more SkyRL overrides ...]
#
# DATA_DIR (default ~/data/hotpotqa-skyrl) is filled from the Hugging Face hub (hotpotqa/hotpot_qa) on the
# first run. SkyRL shuffles every training batch, so questions on one context share their prefix only
# within a group here (verl and TRL keep a context's questions together: see the recipe README).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv-skyrl/bin/python}"
data="${DATA_DIR:-$HOME/data/hotpotqa-skyrl}"
gpus="${NUM_GPUS:-8}"
model="${MODEL:-Qwen/Qwen3-8B}"

if [[ ! -f "$data/train.parquet" ]]; then
    "$python" -m recipes.long_context_qa.data --out "$data/verl" --dataset hotpotqa
    "$python" -m recipes.skyrl_data --src "$data/verl" --out "$data" --env-class long_context_qa
fi

# generator.batched=false: SkyRL's batched generator ignores chat_template_kwargs, and the prompt invites
# reasoning before the <answer> block (Qwen3's thinking mode would add a hidden one).
"$python" -m skyrl.train.entrypoints.main_base \
    data.train_data="['$data/train.parquet']" \
    data.val_data="['$data/test.parquet']" \
    environment.env_class=long_context_qa \
    trainer.policy.model.path="$model" \
    trainer.placement.colocate_all=true \
    trainer.placement.policy_num_gpus_per_node="$gpus" \
    generator.inference_engine.num_engines="$gpus" \
    generator.inference_engine.tensor_parallel_size=1 \
    trainer.epochs=1 \
    trainer.eval_batch_size=512 \
    trainer.eval_before_train=true \
    trainer.eval_interval=50 \
    trainer.update_epochs_per_batch=1 \
    trainer.train_batch_size=64 \
    trainer.policy_mini_batch_size=16 \
    trainer.micro_forward_batch_size_per_gpu=4 \
    trainer.micro_train_batch_size_per_gpu=4 \
    trainer.ckpt_interval=50 \
    trainer.max_prompt_length=4096 \
    generator.sampling_params.max_generate_length=1024 \
    generator.batched=false \
    generator.chat_template_kwargs="{enable_thinking: false}" \
    trainer.policy.optimizer_config.lr=1.0e-6 \
    trainer.algorithm.use_kl_loss=true \
    generator.n_samples_per_prompt=8 \
    trainer.logger="${LOGGER:-console}" \
    trainer.project_name=long_context_qa \
    trainer.run_name=long_context_qa_arctic_rl \
    trainer.ckpt_path="$HOME/ckpts/long_context_qa_arctic_rl" \
    trainer.override_entrypoint=recipes.skyrl_main \
    trainer.arctic_rl="{zorro_train: true, zorro_inference: true, zero_stage: 3}" \
    "$@"
