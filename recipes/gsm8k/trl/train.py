"""GSM8K with TRL's GRPO, on arctic-rl or on TRL alone: the same script, one class apart.

    python -m recipes.gsm8k.data --out ~/data/gsm8k
    python -m recipes.gsm8k.trl.train --data ~/data/gsm8k                   # ArcticGRPOTrainer, 2 GPUs
    python -m recipes.gsm8k.trl.train --data ~/data/gsm8k --colocate        # ArcticGRPOTrainer, 1 GPU
    python -m recipes.gsm8k.trl.train --data ~/data/gsm8k --vanilla         # GRPOTrainer, for comparison
    python -m recipes.gsm8k.trl.train --data ~/data/gsm8k --resume runs/gsm8k-trl/checkpoint-100
    bash recipes/gsm8k/trl/run_cpu_smoke.sh                                 # CPU: tiny model, 16 problems

The dataset is the verl-format parquet of ``recipes.gsm8k.data``: TRL reads
its conversational ``prompt`` column, and passes ``data_source``,
``reward_model`` and ``extra_info`` to the reward, which is the recipe's
strict ``#### <number>`` check through ``recipes.common.trl_reward``. Run
from the repository root.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

from arctic_rl_core import ArcticRLClientConfig
from arctic_rl_trl import ARCTIC_CHECKPOINT, ArcticGRPOTrainer
from recipes.common.trl_reward import trl_reward_func
from recipes.gsm8k.reward import compute_score


def grpo_config(options: argparse.Namespace) -> GRPOConfig:
    """The run's GRPOConfig: TRL's defaults (loss_type="dapo", beta=0) with GSM8K-sized batches."""
    return GRPOConfig(
        output_dir=options.out,
        per_device_train_batch_size=options.prompts_per_step * options.num_generations,
        num_generations=options.num_generations,
        per_device_eval_batch_size=options.prompts_per_step * options.num_generations,
        max_completion_length=options.max_completion_length,
        max_steps=options.steps,
        learning_rate=options.lr,
        temperature=1.0,
        bf16=not options.cpu,
        use_cpu=options.cpu,
        gradient_checkpointing=not options.cpu,
        logging_steps=1,
        eval_strategy="steps" if options.eval_steps else "no",
        eval_steps=options.eval_steps,
        save_strategy="steps",
        save_steps=options.save_steps,
        report_to=options.report_to,
        seed=0,
    )


def arctic_config(options: argparse.Namespace) -> ArcticRLClientConfig:
    """One training GPU and one sampling GPU; with --colocate, both share one GPU."""
    return ArcticRLClientConfig(
        model_name=options.model,
        comm_protocol="ray",
        device="cpu" if options.cpu else "auto",
        training_gpus=1,
        sampling_gpus=1,
        colocate=options.colocate,
        ray_auto_attach=False,
        # Resuming: the engine loads its weights and optimizer state from the checkpoint as it starts.
        checkpoint_path=os.path.join(options.resume, ARCTIC_CHECKPOINT) if options.resume else None,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="directory with train.parquet and test.parquet")
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--out", default="runs/gsm8k-trl")
    parser.add_argument("--vanilla", action="store_true", help="run TRL's own GRPOTrainer instead")
    parser.add_argument("--colocate", action="store_true", help="training and sampling share one GPU")
    parser.add_argument("--cpu", action="store_true", help="run on CPU in float32 (smoke tests)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--eval-steps", type=int, default=50, help="0: no evaluation")
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--report-to", nargs="*", default=[], help="TRL loggers, e.g. tensorboard wandb")
    parser.add_argument("--resume", help="a checkpoint-N directory of an earlier run to continue from")
    options = parser.parse_args(argv)

    files = {split: os.path.join(options.data, f"{split}.parquet") for split in ("train", "test")}
    data = load_dataset("parquet", data_files=files)
    trainer_arguments = dict(
        model=options.model,
        reward_funcs=trl_reward_func(compute_score, "gsm8k"),
        args=grpo_config(options),
        train_dataset=data["train"],
        eval_dataset=data["test"] if options.eval_steps else None,
    )
    if options.vanilla:
        trainer = GRPOTrainer(**trainer_arguments)
    else:
        trainer = ArcticGRPOTrainer(**trainer_arguments, arctic_config=arctic_config(options))
    try:
        trainer.train(resume_from_checkpoint=options.resume)
    finally:
        if not options.vanilla:
            trainer.shutdown()


if __name__ == "__main__":
    main()
