"""Which GRPOConfig options ArcticGRPOTrainer honours, checked before anything starts.

TRL keeps its dataset handling, rewards, advantages, logging and callbacks;
the arctic engines run generation, log-probs, the loss and the optimizer. An
option whose meaning lives on the engine side, and that the engines cannot
reproduce exactly, is refused at construction with its name, its value and
the setting that works. All problems are reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

# TrainingArguments.optim values that are plain AdamW, which is what the training engine runs.
ADAMW_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")

# HF scheduler name -> the engine's training_config["optimizer"]["lr_scheduler_type"].
LR_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


class UnsupportedGRPOOption(ValueError):
    """GRPOConfig or a trainer argument asks for what the arctic engines do not do; the message says what does."""


@dataclass(frozen=True)
class Problem:
    option: str
    value: object
    fix: str

    def __str__(self) -> str:
        return f"{self.option}={self.value!r}: {self.fix}"


def raise_problems(problems: list[Problem]) -> None:
    if problems:
        lines = "\n".join(f"  - {problem}" for problem in problems)
        raise UnsupportedGRPOOption(f"ArcticGRPOTrainer cannot run this configuration:\n{lines}")


def enum_value(option: object) -> str:
    """The string of an enum-valued TrainingArguments field (optim, lr_scheduler_type)."""
    return str(getattr(option, "value", option))


def grpo_config_problems(args: GRPOConfig) -> list[Problem]:
    """Every option of ``args`` the arctic engines cannot honour exactly."""
    upper_clip = 1 + (args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    rules = [
        # Generation runs on the arctic sampling engine.
        ("use_vllm", args.use_vllm,
         "generation runs on the arctic sampling engine; set use_vllm=False (ArcticRLClientConfig.sampling_gpus "
         "sizes the sampler)"),
        ("use_transformers_continuous_batching", args.use_transformers_continuous_batching,
         "generation runs on the arctic sampling engine; set it to False"),
        ("min_p", args.min_p is not None, "the arctic sampler has no min-p filter; set min_p=None"),
        ("repetition_penalty", args.repetition_penalty != 1.0,
         "the arctic sampler applies no repetition penalty; set repetition_penalty=1.0"),
        ("max_completion_length", args.max_completion_length is None,
         "the arctic sampler needs a length limit; set max_completion_length to an integer"),
        ("generation_kwargs", bool(args.generation_kwargs),
         "only temperature, top_p, top_k and max_completion_length reach the arctic sampler; set "
         "generation_kwargs=None"),
        # The loss runs on the training engine as its `grpo` loss.
        ("loss_type", args.loss_type not in SUPPORTED_LOSS_TYPES,
         f"the arctic grpo loss reproduces {', '.join(SUPPORTED_LOSS_TYPES)}"),
        ("epsilon", not 0 < args.epsilon < 1,
         "the arctic grpo loss clips the ratio below at 1 - epsilon, which must stay in (0, 1) (eps_clip < 1); "
         "set 0 < epsilon < 1 (epsilon_high may be larger)"),
        ("epsilon_high", args.epsilon_high is not None and args.epsilon_high <= 0,
         "the arctic grpo loss clips the ratio above at 1 + epsilon_high with epsilon_high > 0; set a positive "
         "value or None"),
        ("importance_sampling_level", args.importance_sampling_level != "token",
         "the arctic grpo loss takes per-token ratios; set importance_sampling_level='token'"),
        ("delta", args.delta is not None and args.delta <= upper_clip,
         f"two-sided clipping maps onto the dual clip only above 1 + epsilon_high (= {upper_clip}); raise delta "
         "or set delta=None"),
        ("use_bias_correction_kl", args.beta != 0.0 and args.use_bias_correction_kl,
         "the arctic grpo loss adds the KL term without the importance ratio; set use_bias_correction_kl=False"),
        ("sync_ref_model", args.sync_ref_model,
         "the reference model lives on the arctic log-prob job and is never mixed with the policy; set "
         "sync_ref_model=False"),
        ("top_entropy_quantile", args.top_entropy_quantile != 1.0,
         "the arctic grpo loss trains on every completion token; set top_entropy_quantile=1.0"),
        ("off_policy_mask_threshold", args.off_policy_mask_threshold is not None,
         "off-policy sequence masking is not part of the arctic grpo loss; set off_policy_mask_threshold=None"),
        ("use_adaptive_entropy", args.use_adaptive_entropy,
         "the entropy coefficient is fixed for a run on the arctic engine; set use_adaptive_entropy=False"),
        ("entropy_coef", args.entropy_coef != 0.0 and args.loss_type == "grpo",
         "with loss_type='grpo' the entropy bonus (a token mean) and the policy loss (a sequence mean) would need "
         "two aggregations; use loss_type 'dapo', 'bnpo' or 'dr_grpo', or entropy_coef=0.0"),
        ("cast_lm_head_to_fp32", args.cast_lm_head_to_fp32,
         "the arctic engine runs the LM head in its training dtype and log-softmax in float32; set "
         "cast_lm_head_to_fp32=False"),
        # The optimizer, its schedule, the parallelism and the weights are the training engine's.
        ("optim", enum_value(args.optim) not in ADAMW_OPTIMIZERS,
         f"the arctic training engine runs torch AdamW; use one of {', '.join(ADAMW_OPTIMIZERS)}"),
        ("lr_scheduler_type", enum_value(args.lr_scheduler_type) not in LR_SCHEDULERS,
         f"the arctic training engine schedules {', '.join(LR_SCHEDULERS)}"),
        ("lr_scheduler_kwargs", bool(args.lr_scheduler_kwargs),
         "the arctic schedules take no extra arguments; set lr_scheduler_kwargs=None"),
        ("deepspeed", bool(args.deepspeed),
         "the arctic training engine runs DeepSpeed itself; pass the DeepSpeed config as "
         "ArcticRLClientConfig(ds_config=...)"),
        ("fsdp", bool(args.fsdp),
         "the arctic training engine shards with DeepSpeed ZeRO; drop fsdp and pass "
         "ArcticRLClientConfig(ds_config={'zero_optimization': {'stage': 3}})"),
        ("load_best_model_at_end", args.load_best_model_at_end,
         "the weights live on the arctic training engine, which does not reload them mid-run; set "
         "load_best_model_at_end=False"),
        ("push_to_hub", args.push_to_hub,
         "checkpoints hold the arctic engine's DeepSpeed files, not Hub weights; set push_to_hub=False"),
    ]  # fmt: skip
    return [Problem(option, getattr(args, option), fix) for option, refused, fix in rules if refused]
