"""GRPOConfig's optimizer, schedule and precision as the training engine's ``training_config``.

The arctic training engine owns the optimizer, so GRPOConfig's AdamW
hyperparameters, clipping, schedule and precision are written into the
deployment's ``training_config`` when the trainer starts it. They are set in
one place only: a ``training_config`` that already names them differently is
refused at construction, naming both values.
"""

from __future__ import annotations

from trl import GRPOConfig

from arctic_rl_core import ArcticRLClientConfig
from arctic_rl_trl.compat import LR_SCHEDULERS, Problem, enum_value


def training_dtype(args: GRPOConfig) -> str:
    """TRL trains in bf16 (or fp16) autocast when asked, else in float32."""
    if args.bf16:
        return "bfloat16"
    if args.fp16:
        return "float16"
    return "float32"


def training_config_from_grpo(args: GRPOConfig, max_steps: int, no_decay_params: list[str] | None = None) -> dict:
    """The ``training_config`` entries that GRPOConfig decides, for a run of ``max_steps`` optimizer steps.

    ``no_decay_params``: the parameters HF's Trainer leaves undecayed (the trainer passes its own choice).
    """
    scheduler = enum_value(args.lr_scheduler_type)
    # HF's "constant" schedule ignores warmup_steps; only "constant_with_warmup" ramps up.
    warmup_steps = 0 if scheduler == "constant" else args.get_warmup_steps(max_steps)
    optimizer = {
        "lr": args.learning_rate,
        "weight_decay": args.weight_decay,
        "beta1": args.adam_beta1,
        "beta2": args.adam_beta2,
        "eps": args.adam_epsilon,
        "gradient_clipping": args.max_grad_norm,
        "lr_scheduler_type": LR_SCHEDULERS[scheduler],
        "warmup_steps": warmup_steps,
        "total_train_steps": max_steps,
    }
    if no_decay_params is not None:
        optimizer["no_decay_params"] = list(no_decay_params)
    return {
        "optimizer": optimizer,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "dtype": training_dtype(args),
    }


def training_config_problems(user: dict | None, args: GRPOConfig) -> list[Problem]:
    """What in the deployment's own ``training_config`` contradicts GRPOConfig."""
    user = user or {}
    problems = []
    if "optimizer" in user:
        problems.append(
            Problem(
                "ArcticRLClientConfig.training_config['optimizer']",
                user["optimizer"],
                "ArcticGRPOTrainer sets the optimizer from GRPOConfig (learning_rate, adam_*, weight_decay, "
                "max_grad_norm, lr_scheduler_type, warmup); remove it from the arctic config",
            )
        )
    derived = {"gradient_checkpointing": bool(args.gradient_checkpointing), "dtype": training_dtype(args)}
    for key, wanted in derived.items():
        if key in user and user[key] != wanted:
            problems.append(
                Problem(
                    f"ArcticRLClientConfig.training_config[{key!r}]",
                    user[key],
                    f"GRPOConfig asks for {wanted!r} (dtype follows bf16/fp16); set the two alike",
                )
            )
    return problems


def with_grpo_training_config(
    config: ArcticRLClientConfig, args: GRPOConfig, max_steps: int, no_decay_params: list[str] | None = None
) -> ArcticRLClientConfig:
    """``config`` with GRPOConfig's training options merged into its ``training_config`` (checked beforehand).

    TRL computes old and reference log-probs ``per_device_train_batch_size`` rows at a time, so forward-only
    calls get that row bound unless the deployment's ``mb_spec`` names its own.
    """
    user = config.training_config or {}
    mb_spec = {"max_rows_per_forward_mb": args.per_device_train_batch_size, **user.get("mb_spec", {})}
    merged = {**user, **training_config_from_grpo(args, max_steps, no_decay_params), "mb_spec": mb_spec}
    return config.model_copy(update={"training_config": merged})


def with_processed_logprobs(config: ArcticRLClientConfig) -> ArcticRLClientConfig:
    """``config`` whose sampler reports processed log-probs, unless its ``vllm_config`` names a mode.

    TRL runs its own vLLM with ``logprobs_mode="processed_logprobs"`` (log-probs of the distribution a token
    was drawn from: temperature, top-k, top-p), which its importance-sampling correction assumes.
    """
    vllm_config = config.vllm_config or {}
    if "logprobs_mode" in vllm_config:
        return config
    return config.model_copy(update={"vllm_config": {**vllm_config, "logprobs_mode": "processed_logprobs"}})
