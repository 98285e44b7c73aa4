#!/usr/bin/env bash
# SkyRL GRPO on Txt2SQL with arctic-rl as the backend: Qwen3-8B on Spider, one node of $NUM_GPUS GPUs
# (default 8, 80 GB or more each), training, sampling and the KL reference colocated, ZoRRo on. Rewards
# come from recipes.txt2sql.reward in the txt2sql skyrl-gym environment (recipes/skyrl_env.py).
#
#   bash integrations/arctic_rl_skyrl/install_env.sh            # once: the Python 3.12 environment
#   SPIDER=~/spider_data bash recipes/txt2sql/skyrl/run_gpu.sh [more SkyRL overrides ...]
#
# DATA_DIR (default ~/data/spider-skyrl) is made from the Spider release in SPIDER on the first run
# (https://yale-lily.github.io/spider).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv-skyrl/bin/python}"
data="${DATA_DIR:-$HOME/data/spider-skyrl}"
gpus="${NUM_GPUS:-8}"
model="${MODEL:-Qwen/Qwen3-8B}"

if [[ ! -f "$data/train.parquet" ]]; then
    "$python" -m recipes.txt2sql.data --out "$data/verl" --source spider \
        --root "${SPIDER:?set SPIDER to the unzipped Spider release}"
    "$python" -m recipes.skyrl_data --src "$data/verl" --out "$data" --env-class txt2sql --splits train dev
fi

# generator.batched=false: SkyRL's batched generator ignores chat_template_kwargs, and the prompt asks for
# step-by-step reasoning before the <sql> block (Qwen3's thinking mode would add a hidden one).
"$python" -m skyrl.train.entrypoints.main_base \
    data.train_data="['$data/train.parquet']" \
    data.val_data="['$data/dev.parquet']" \
    environment.env_class=txt2sql \
    trainer.policy.model.path="$model" \
    trainer.placement.colocate_all=true \
    trainer.placement.policy_num_gpus_per_node="$gpus" \
    generator.inference_engine.num_engines="$gpus" \
    generator.inference_engine.tensor_parallel_size=1 \
    trainer.epochs=5 \
    trainer.eval_batch_size=512 \
    trainer.eval_before_train=true \
    trainer.eval_interval=20 \
    trainer.update_epochs_per_batch=1 \
    trainer.train_batch_size=64 \
    trainer.policy_mini_batch_size=16 \
    trainer.micro_forward_batch_size_per_gpu=8 \
    trainer.micro_train_batch_size_per_gpu=8 \
    trainer.ckpt_interval=20 \
    trainer.max_prompt_length=2048 \
    generator.sampling_params.max_generate_length=2048 \
    generator.batched=false \
    generator.chat_template_kwargs="{enable_thinking: false}" \
    trainer.policy.optimizer_config.lr=1.0e-6 \
    trainer.algorithm.use_kl_loss=true \
    generator.n_samples_per_prompt=8 \
    trainer.logger="${LOGGER:-console}" \
    trainer.project_name=txt2sql \
    trainer.run_name=txt2sql_arctic_rl \
    trainer.ckpt_path="$HOME/ckpts/txt2sql_arctic_rl" \
    trainer.override_entrypoint=recipes.skyrl_main \
    trainer.arctic_rl="{zorro_train: true, zorro_inference: true, zero_stage: 3}" \
    "$@"
