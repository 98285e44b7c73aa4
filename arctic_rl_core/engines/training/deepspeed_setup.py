"""Turning a TrainingConfig into a DeepSpeed config, an optimizer and an LR schedule."""

from __future__ import annotations

import copy
import math

import torch

from arctic_rl_core.config import OptimizerConfig, TrainingConfig


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; ``override`` wins."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build_ds_config(user: dict, training: TrainingConfig | None, dtype: str) -> dict:
    """Our defaults under the user's ``ds_config``.

    Micro-batching is ours (token budgets, see ``mb_spec``), so DeepSpeed sees
    one micro-batch per backward and we mark accumulation boundaries ourselves.
    A torch optimizer is used unless the user's config names one (DeepSpeed's
    CPU/fused Adam need a multi-minute JIT build).
    """
    defaults = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
    }
    if training is not None:
        defaults["gradient_clipping"] = training.optimizer.gradient_clipping
    config = merge(defaults, user)
    if config.get("gradient_accumulation_steps", 1) != 1 or config.get("train_micro_batch_size_per_gpu", 1) != 1:
        raise ValueError(
            "ds_config: gradient_accumulation_steps and train_micro_batch_size_per_gpu must stay 1; "
            "arctic-rl accumulates over micro-batches and fwd_bwd calls until step() (use training_config.mb_spec)"
        )
    config.pop("train_batch_size", None)
    return config


def build_optimizer(params, config: OptimizerConfig, device: str) -> torch.optim.Optimizer:
    params = [(name, param) for name, param in params if param.requires_grad]
    if config.no_decay_params is None:
        # Biases and norm weights are not decayed: the usual AdamW recipe.
        skip = {name for name, param in params if param.dim() < 2}
    else:
        skip = set(config.no_decay_params)
        unknown = sorted(skip - {name for name, _ in params})
        if unknown:
            raise ValueError(f"training_config.optimizer.no_decay_params: the model has no trainable {unknown}")
    decay = [param for name, param in params if name not in skip]
    no_decay = [param for name, param in params if name in skip]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.name == "sgd":
        return torch.optim.SGD([g for g in groups if g["params"]], lr=config.lr)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        foreach=device == "cuda",
    )


def lr_multiplier(config: OptimizerConfig):
    """Optimizer step -> multiplier of the base lr: linear warmup, then constant/linear/cosine decay.

    The formulas are HF's and verl's (``get_*_schedule_with_warmup``), so a
    run moved onto arctic-rl keeps its learning rates: warmup ramps as
    step / warmup from 0, and the schedule advances once every
    ``lr_schedule_interval`` optimizer steps.
    """
    total = config.total_train_steps
    warmup = config.num_warmup_steps

    def at(optimizer_step: int) -> float:
        step = optimizer_step // config.lr_schedule_interval
        if step < warmup:
            return step / warmup
        if config.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        floor = config.min_lr_ratio
        if config.lr_scheduler_type == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return at
