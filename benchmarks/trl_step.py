"""Time per GRPO step: TRL's GRPOTrainer against ArcticGRPOTrainer, same model, data and GRPOConfig, one run.

A step is everything between the Trainer's ``on_step_begin`` and ``on_step_end``
callbacks: generation, rewards and advantages, log-probs, forward and backward,
the optimizer step (and, for arctic, the weight sync to its sampler). The
first step of each side is a warm-up and is left out of the mean. The arctic
deployment's start-up is reported separately and not counted.

Vanilla TRL generates with ``model.generate`` and trains in its own process;
ArcticGRPOTrainer samples on the arctic sampling engine (``--sampler``) and
trains on the DeepSpeed training engine. With GRPOConfig's default
``vllm_importance_sampling_correction=True`` the arctic side also runs one
forward per generation batch for the sampler/trainer correction, which
vanilla TRL (without vLLM) does not do.

    python benchmarks/trl_step.py                      # CPU: tiny Qwen2, fp32
    python benchmarks/trl_step.py --device cuda --colocate --layers 8 --hidden 1024 --completion-length 128 \\
        --prompts 8 --steps 4                          # H200: the recorded line (integrations/arctic_rl_trl/README.md)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client  # noqa: E402
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model  # noqa: E402
from arctic_rl_trl import ArcticGRPOTrainer, training_config_from_grpo  # noqa: E402

WORDS = "apple river stone cloud seven green table music light paper ocean forest".split()


class StepTimer(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._started)


def digit_reward(tokenizer):
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}

    def digit_share(completion_ids, **_):
        return [sum(token in digits for token in ids) / max(len(ids), 1) for ids in completion_ids]

    return digit_share


def grpo_args(options, output_dir: Path) -> GRPOConfig:
    cuda = options.device == "cuda"
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=options.prompts * options.generations,
        num_generations=options.generations,
        max_completion_length=options.completion_length,
        max_steps=options.steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        logging_steps=options.steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )


def timed_run(trainer_class, model: str, options, output_dir: Path, **arctic) -> list[float]:
    timer = StepTimer()
    prompts = [f"Write digits after {word}:" for word in WORDS]
    trainer = trainer_class(
        model=model,
        reward_funcs=digit_reward(AutoTokenizer.from_pretrained(model)),
        args=grpo_args(options, output_dir),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[timer],
        **arctic,
    )
    trainer.train()
    if trainer_class is ArcticGRPOTrainer:
        trainer.shutdown()
    return timer.seconds


def summary(name: str, seconds: list[float]) -> float:
    steady = seconds[1:]
    mean = statistics.mean(steady)
    spread = statistics.stdev(steady) if len(steady) > 1 else 0.0
    print(f"{name:>8}: {mean:.3f} s/step (± {spread:.3f}, {len(steady)} steps after 1 warm-up)")
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per side, the first one a warm-up")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (heads of 64)")
    parser.add_argument("--sampler", choices=("native", "vllm"), default="native")
    parser.add_argument("--colocate", action="store_true", help="arctic training and sampling share one GPU")
    options = parser.parse_args()
    if options.steps < 3:
        parser.error("--steps must be at least 3: one warm-up and two timed steps")

    root = Path(tempfile.mkdtemp(prefix="trl-step-"))
    spec = TinySpec(
        family="qwen2", num_layers=options.layers, hidden_size=options.hidden, num_heads=options.hidden // 64,
        intermediate_size=4 * options.hidden,
    )  # fmt: skip
    model = str(build_tiny_model(root / "model", spec))
    print(f"model: qwen2, {options.layers} layers, hidden {options.hidden}; device {options.device}; "
          f"{options.prompts} prompts x {options.generations} completions of up to {options.completion_length} "
          f"tokens per step")  # fmt: skip
    if options.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}")

    vanilla = summary("vanilla", timed_run(GRPOTrainer, model, options, root / "vanilla"))

    config = ArcticRLClientConfig(
        model_name=model, comm_protocol="ray", device=options.device, training_gpus=1, sampling_gpus=1,
        sampling_engine=options.sampler, colocate=options.colocate, ray_auto_attach=False, server_logs=False,
        training_config=training_config_from_grpo(grpo_args(options, root), options.steps),
    )  # fmt: skip
    started = time.perf_counter()
    client = create_arctic_rl_client(config)
    print(f"arctic deployment start-up: {time.perf_counter() - started:.1f} s (not counted)")
    try:
        arctic = summary("arctic", timed_run(ArcticGRPOTrainer, model, options, root / "arctic", arctic_client=client))
    finally:
        asyncio.run(client.shutdown())
    print(f"ratio vanilla / arctic time per step: {vanilla / arctic:.2f}x")


if __name__ == "__main__":
    main()
