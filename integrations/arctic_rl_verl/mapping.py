"""verl's settings in arctic-rl's terms: the ``grpo`` processor config, and what cannot be served.

verl's PPO/GRPO actor loss (``verl.workers.utils.losses.ppo_loss`` with the
``vanilla`` policy loss) maps onto arctic-rl's ``grpo`` processor term by term:

=============================================  ==============================================
verl                                           arctic-rl ``grpo`` config / batch
=============================================  ==============================================
actor.clip_ratio_low (else clip_ratio)         eps_clip
actor.clip_ratio_high (else clip_ratio)        eps_clip_high
actor.clip_ratio_c (dual clip, always on)      clip_ratio_c
actor.loss_agg_mode                            loss_agg_mode
actor.entropy_coeff                            entropy_coef
actor.use_kl_loss, actor.kl_loss_coef          kl_coef (0 without use_kl_loss)
actor.kl_loss_type                             kl_estimator (kl/k1, mse/k2, low_var_kl/k3, abs)
algorithm.rollout_correction                   decoupled PPO: verl's old_log_probs are the
  (rollout_is=token, float threshold)            proximal policy, its rollout_log_probs the
                                                 behaviour policy, behav_imp_weight_cap =
                                                 rollout_is_threshold (truncate: token TIS)
rollout.temperature                            ``temperature`` post-processor, per call
                                                 (1.0, top_k off and top_p 1.0 under token TIS)
=============================================  ==============================================

verl's optimizer settings (``actor.optim``) become the training engine's:
AdamW with ``lr``, ``weight_decay`` (on every parameter, as verl's AdamW),
``betas``, ``clip_grad`` and a constant or cosine schedule with warmup
(``lr_warmup_steps`` or ``lr_warmup_steps_ratio``) and ``min_lr_ratio``. verl
advances its schedule once per training step, after all of that step's
optimizer steps (``train_batch_size / ppo_mini_batch_size * ppo_epochs``), and
so does the engine (``lr_schedule_interval``): every optimizer step runs at
verl's learning rate.

Everything else that would change the numbers is refused here, at startup,
by a :class:`UnsupportedVerlSetting` that names the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, get_args

from arctic_rl_core import ArcticRLClientConfig
from arctic_rl_core.engines.sampling.protocol import LogprobsMode
from arctic_rl_core.processors import ClippedPolicyConfig

# verl_settings key -> where verl keeps it (the names errors use).
VERL_PATHS = {
    "adv_estimator": "algorithm.adv_estimator",
    "use_kl_in_reward": "algorithm.use_kl_in_reward",
    "rollout_correction": "algorithm.rollout_correction",
    "critic_enable": "critic.enable",
    "n_gpus_per_node": "trainer.n_gpus_per_node",
    "nnodes": "trainer.nnodes",
    "use_v1": "trainer.use_v1",
    "trainer_mode": "trainer.v1.trainer_mode",
    "hybrid_engine": "actor_rollout_ref.hybrid_engine",
    "rollout_name": "actor_rollout_ref.rollout.name",
    "rollout_tensor_model_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "rollout_data_parallel_size": "actor_rollout_ref.rollout.data_parallel_size",
    "rollout_pipeline_model_parallel_size": "actor_rollout_ref.rollout.pipeline_model_parallel_size",
    "rollout_temperature": "actor_rollout_ref.rollout.temperature",
    "rollout_logprobs_mode": "actor_rollout_ref.rollout.logprobs_mode",
    "rollout_calculate_log_probs": "actor_rollout_ref.rollout.calculate_log_probs",
    "rollout_repetition_penalty": "actor_rollout_ref.rollout.repetition_penalty",
    "lora_rank": "actor_rollout_ref.model.lora_rank",
    "lora_config_rank": "actor_rollout_ref.model.lora.rank",
    "lora_adapter_path": "actor_rollout_ref.model.lora_adapter_path",
    "reward_model_enable": "reward.reward_model.enable",
    "distillation_enabled": "distillation.enabled",
    "train_batch_size": "data.train_batch_size",
    "max_actor_ckpt_to_keep": "trainer.max_actor_ckpt_to_keep",
}

ACTOR = "actor_rollout_ref.actor"
ARCTIC = f"{ACTOR}.arctic"

# verl's KL estimator names -> arctic-rl's (both sets are accepted by the grpo config).
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")


class UnsupportedVerlSetting(ValueError):
    """A verl setting arctic-rl cannot serve as asked; the message names it, its value and what works."""

    def __init__(self, path: str, value: Any, expected: str):
        super().__init__(f"{path}={value!r} is not supported by the arctic backend: {expected}")
        self.path = path


@dataclass(frozen=True)
class PolicyLoss:
    """The ``grpo`` config for verl's actor loss, and whether rollout log-probs are the behaviour policy."""

    config: dict
    decoupled: bool


def _settings(verl_settings: Mapping[str, Any]) -> dict[str, Any]:
    missing = sorted(set(VERL_PATHS) - set(verl_settings))
    if missing:
        raise ValueError(
            f"{ACTOR}.verl_settings lacks {missing}: select the arctic config group "
            "(hydra.searchpath=[pkg://arctic_rl_verl.conf] model_engine=arctic) rather than building it by hand"
        )
    return dict(verl_settings)


def needs_reference(actor, verl_settings: Mapping[str, Any]) -> bool:
    """Whether verl will ask for reference log-probs (KL loss or KL in the reward)."""
    return bool(actor.use_kl_loss or verl_settings["use_kl_in_reward"])


_ONE_CLIENT = (
    "verl's side is one client process; arctic-rl places and shards the compute on its own GPUs "
    f"({ARCTIC}.training_gpus/sampling_gpus/log_prob_gpus): set it to 1"
)
_CRITIC = (
    "arctic-rl serves no value model (critic); use a critic-free estimator such as grpo, rloo or reinforce_plus_plus"
)

# verl_settings key, when it is refused, and what works instead; checked in this order.
RUN_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("critic_enable", bool, _CRITIC),
    ("adv_estimator", lambda value: value == "gae", _CRITIC),
    ("n_gpus_per_node", lambda value: value != 1, _ONE_CLIENT),
    ("nnodes", lambda value: value != 1, _ONE_CLIENT),
    ("rollout_tensor_model_parallel_size", lambda value: value != 1, _ONE_CLIENT),
    ("rollout_data_parallel_size", lambda value: value != 1, _ONE_CLIENT),
    ("rollout_pipeline_model_parallel_size", lambda value: value != 1, _ONE_CLIENT),
    ("use_v1", lambda value: not value, "the arctic backend plugs into verl's v1 trainer (true)"),
    ("trainer_mode", lambda value: value != "sync", "only the synchronous trainer is mapped (sync)"),
    ("hybrid_engine", lambda value: not value, "the arctic sampler serves verl's hybrid rollout (true)"),
    (
        "rollout_name",
        lambda value: value != "arctic",
        "the arctic engine keeps the weights inside arctic-rl, so arctic's sampler must serve the rollout (arctic)",
    ),
    ("rollout_repetition_penalty", lambda value: value != 1.0, "arctic-rl samples without a penalty (1.0)"),
    (
        "rollout_logprobs_mode",
        lambda value: value not in get_args(LogprobsMode),
        "arctic-rl's samplers report log-probs, not logits (processed_logprobs or raw_logprobs)",
    ),
    ("lora_rank", lambda value: bool(value and value > 0), "arctic-rl trains full weights; LoRA is not mapped (0)"),
    (
        "lora_config_rank",
        lambda value: bool(value and value > 0),
        "arctic-rl trains full weights; LoRA is not mapped (0)",
    ),
    ("lora_adapter_path", bool, "LoRA adapters are not mapped (null)"),
    ("reward_model_enable", bool, "a model reward needs a sampler of its own; use a rule/function reward (false)"),
    ("distillation_enabled", bool, "on-policy distillation is not mapped (false)"),
    (
        "max_actor_ckpt_to_keep",
        lambda value: value is not None,
        "arctic-rl's training engine writes the checkpoints and does not prune them (null)",
    ),
)


def check_run(actor, verl_settings: Mapping[str, Any]) -> None:
    """Refuse the run-level verl settings arctic-rl cannot serve (``policy_loss`` checks the loss terms)."""
    s = _settings(verl_settings)
    for key, refused, expected in RUN_RULES:
        if refused(s[key]):
            raise UnsupportedVerlSetting(VERL_PATHS[key], s[key], expected)
    if needs_reference(actor, s) and actor.arctic.log_prob_gpus < 1:
        raise UnsupportedVerlSetting(
            f"{ARCTIC}.log_prob_gpus",
            actor.arctic.log_prob_gpus,
            "a KL term (actor.use_kl_loss or algorithm.use_kl_in_reward) needs the reference log-probs of "
            "arctic-rl's log-prob engine: set it to 1 or more",
        )
    # verl asks for the reference log-probs at the rollout temperature; the vLLM log-prob job applies none.
    if needs_reference(actor, s) and actor.arctic.log_prob_engine == "vllm" and s["rollout_temperature"] != 1.0:
        raise UnsupportedVerlSetting(
            f"{ARCTIC}.log_prob_engine",
            actor.arctic.log_prob_engine,
            f"verl computes the reference log-probs at {VERL_PATHS['rollout_temperature']}="
            f"{s['rollout_temperature']}, and arctic-rl's vLLM log-prob engine applies no temperature: "
            "use 'deepspeed' (or a rollout temperature of 1.0)",
        )
    _check_checkpoint_path(actor.arctic.checkpoint_path)


# Where verl's trainer has the engine save the actor; arctic-rl resumes from there.
RESUME_DIRECTORY = "<trainer.default_local_dir>/global_step_<N>/actor"


def _check_checkpoint_path(checkpoint_path: str | None) -> None:
    """Refuse a checkpoint path the training job would silently not resume from.

    arctic-rl's training worker resumes only from a directory holding DeepSpeed's
    ``latest`` file (verl's ``<trainer.default_local_dir>/global_step_<N>/actor``,
    the ``local_path`` verl gives ``save_checkpoint``); from any other directory it
    starts from the base weights, which is right for a new or empty one. An
    existing directory without ``latest`` that is a step directory (DeepSpeed's
    ``global_stepN`` tag inside it, or verl's ``global_step_<N>``) or verl's
    ``trainer.default_local_dir`` is a resume that would not happen.
    """
    if not checkpoint_path:
        return
    path = Path(checkpoint_path)
    if not path.is_dir() or (path / "latest").is_file():
        return
    if (path.parent / "latest").is_file():
        instead = str(path.parent)  # DeepSpeed's tag directory: the checkpoint is its parent
    elif (path / "actor" / "latest").is_file():
        instead = str(path / "actor")  # verl's global_step_<N>
    elif (path / "latest_checkpointed_iteration.txt").is_file():
        step = (path / "latest_checkpointed_iteration.txt").read_text().strip()
        instead = str(path / f"global_step_{step}" / "actor")  # verl's trainer.default_local_dir
    elif path.name.startswith("global_step"):
        instead = None  # a step directory on its own: which checkpoint it belonged to is unknown
    else:
        return
    where = f"{RESUME_DIRECTORY}, where the arctic engine saved the actor"
    raise UnsupportedVerlSetting(
        f"{ARCTIC}.checkpoint_path",
        checkpoint_path,
        "arctic-rl's training job resumes only from a directory holding DeepSpeed's 'latest' file, and this one "
        "has none, so training would start from the base weights: set it to "
        + (f"{instead!r} ({where})" if instead else where),
    )


def policy_loss(actor, verl_settings: Mapping[str, Any]) -> PolicyLoss:
    """The ``grpo`` processor config equal to verl's ``ppo_loss`` under ``actor`` and the rollout correction."""
    s = _settings(verl_settings)
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    if loss_mode != "vanilla":
        raise UnsupportedVerlSetting(f"{ACTOR}.policy_loss.loss_mode", loss_mode, "only 'vanilla' (PPO clip) is mapped")
    if actor.loss_agg_mode not in LOSS_AGG_MODES:
        raise UnsupportedVerlSetting(
            f"{ACTOR}.loss_agg_mode",
            actor.loss_agg_mode,
            f"mapped modes are {', '.join(LOSS_AGG_MODES)}; Dr. GRPO's seq-mean-token-sum-norm divides by verl's "
            "response horizon (or loss_scale_factor), arctic-rl's by the padded sequence length",
        )
    if actor.kl_loss_type not in KL_ESTIMATORS:
        raise UnsupportedVerlSetting(
            f"{ACTOR}.kl_loss_type",
            actor.kl_loss_type,
            f"mapped estimators are {', '.join(KL_ESTIMATORS)} (no straight-through '+' variants, no 'full')",
        )
    if actor.calculate_sum_pi_squared:
        raise UnsupportedVerlSetting(f"{ACTOR}.calculate_sum_pi_squared", True, "not mapped (false)")
    if actor.use_prefix_grouper:
        raise UnsupportedVerlSetting(
            f"{ACTOR}.use_prefix_grouper",
            True,
            f"arctic-rl shares prompts with ZoRRo Train instead ({ARCTIC}.zorro_train=true)",
        )
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    config = {
        "eps_clip": low,
        "eps_clip_high": high,
        "clip_ratio_c": actor.clip_ratio_c,
        "loss_agg_mode": actor.loss_agg_mode,
        # verl's seq-mean modes divide by global_batch_size, a mini-batch's rows, fully masked ones included.
        "num_sequences": actor.ppo_mini_batch_size * actor.rollout_n,
        "entropy_coef": actor.entropy_coeff,
        "kl_coef": actor.kl_loss_coef if actor.use_kl_loss else 0.0,
        "kl_estimator": KL_ESTIMATORS[actor.kl_loss_type],
    }
    decoupled = _rollout_correction(s)
    if decoupled is not None:
        config["behav_imp_weight_cap"] = decoupled
        config["behav_imp_weight_mode"] = "truncate"
    try:
        ClippedPolicyConfig.model_validate(config)
    except ValueError as exc:
        raise ValueError(f"{ACTOR}: the mapped grpo config {config} is invalid: {exc}") from None
    return PolicyLoss(config=config, decoupled=decoupled is not None)


def _rollout_correction(s: dict[str, Any]) -> float | None:
    """The TIS cap when verl weights tokens by pi_old / pi_rollout, else None; refuses the other corrections."""
    correction = s["rollout_correction"] or {}
    path = VERL_PATHS["rollout_correction"]
    if correction.get("bypass_mode", False):
        raise UnsupportedVerlSetting(f"{path}.bypass_mode", True, "only decoupled mode is mapped (false)")
    if correction.get("rollout_rs") is not None:
        raise UnsupportedVerlSetting(
            f"{path}.rollout_rs", correction["rollout_rs"], "rejection sampling is not mapped (null)"
        )
    if correction.get("rollout_is_batch_normalize", False):
        raise UnsupportedVerlSetting(f"{path}.rollout_is_batch_normalize", True, "not mapped (false)")
    level = correction.get("rollout_is")
    if level is None:
        return None
    if level != "token":
        raise UnsupportedVerlSetting(f"{path}.rollout_is", level, "only token-level TIS is mapped ('token' or null)")
    cap = _tis_cap(f"{path}.rollout_is_threshold", correction.get("rollout_is_threshold", 2.0))
    if not s["rollout_calculate_log_probs"]:
        raise UnsupportedVerlSetting(
            VERL_PATHS["rollout_calculate_log_probs"], False, "token TIS needs the sampler's log-probs (true)"
        )
    # The behaviour log-probs are what rollout.logprobs_mode says, as from verl's vLLM rollout: the sampler
    # reports them in that mode (client_config), so temperature, top-k and top-p need no refusal.
    return cap


def _tis_cap(path: str, threshold: Any) -> float:
    """verl's single upper bound (TIS); refuses what verl reads as IcePop's lower and upper bounds.

    verl (``rollout_corr_helper._parse_rollout_is_threshold``) takes a string with
    a "_" as "lower_upper" before it tries a number. Python's ``float`` would read
    the same "_" as a digit separator ("1_10" -> 110.0), so it cannot decide.
    """
    single = "a single positive upper bound (TIS); IcePop's 'lower_upper' bounds are not mapped"
    icepop = isinstance(threshold, str) and "_" in threshold
    if icepop or isinstance(threshold, bool) or not isinstance(threshold, (str, int, float)):
        raise UnsupportedVerlSetting(path, threshold, single)
    try:
        cap = float(threshold)
    except ValueError:
        raise UnsupportedVerlSetting(path, threshold, single) from None
    if not cap > 0:
        raise UnsupportedVerlSetting(path, threshold, single)
    return cap


def optimizer_steps_per_training_step(actor, verl_settings: Mapping[str, Any]) -> int:
    """How many times verl steps the optimizer in one training step: mini-batches times PPO epochs."""
    s = _settings(verl_settings)
    mini_batches, rest = divmod(s["train_batch_size"], actor.ppo_mini_batch_size)
    if rest:
        raise UnsupportedVerlSetting(
            f"{ACTOR}.ppo_mini_batch_size",
            actor.ppo_mini_batch_size,
            f"a divisor of {VERL_PATHS['train_batch_size']}={s['train_batch_size']}",
        )
    return mini_batches * actor.ppo_epochs


def optimizer_settings(optim, steps_per_training_step: int) -> dict:
    """``training_config["optimizer"]`` for verl's ``actor.optim``; refuses what arctic-rl's AdamW cannot do.

    verl sets ``total_training_steps`` only once the trainer knows the dataset:
    before that (-1) the horizon is left out.
    """
    path = f"{ACTOR}.optim"
    name = str(optim.get("optimizer", "AdamW"))
    if name.lower() != "adamw":
        raise UnsupportedVerlSetting(f"{path}.optimizer", name, "arctic-rl trains with AdamW")
    implementation = optim.get("optimizer_impl", "torch.optim")
    if implementation != "torch.optim":
        raise UnsupportedVerlSetting(f"{path}.optimizer_impl", implementation, "arctic-rl uses torch.optim's AdamW")
    if optim.get("override_optimizer_config"):
        raise UnsupportedVerlSetting(
            f"{path}.override_optimizer_config", optim.override_optimizer_config, "not mapped (null)"
        )
    schedule = optim.get("lr_scheduler_type", "constant")
    if schedule not in ("constant", "cosine"):
        raise UnsupportedVerlSetting(f"{path}.lr_scheduler_type", schedule, "constant or cosine")
    if schedule == "cosine" and optim.get("num_cycles", 0.5) != 0.5:
        raise UnsupportedVerlSetting(
            f"{path}.num_cycles", optim.num_cycles, "arctic-rl's cosine is one half cycle (0.5)"
        )
    if schedule == "cosine" and not optim.get("zero_indexed_step", True):
        raise UnsupportedVerlSetting(f"{path}.zero_indexed_step", False, "true (the schedule counts from step 0)")
    total = optim.total_training_steps
    settings = {
        "lr": optim.lr,
        "weight_decay": optim.weight_decay,
        "no_decay_params": [],
        "beta1": optim.betas[0],
        "beta2": optim.betas[1],
        "gradient_clipping": optim.grad_clip if optim.get("grad_clip") is not None else optim.clip_grad,
        "lr_scheduler_type": schedule,
        "min_lr_ratio": optim.get("min_lr_ratio") or 0.0,
        "lr_schedule_interval": steps_per_training_step,
    }
    if total > 0:
        warmup_steps = optim.get("lr_warmup_steps") or -1
        settings["total_train_steps"] = total
        # verl's own count: lr_warmup_steps when positive, else the ratio's floor.
        settings["warmup_steps"] = warmup_steps if warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total)
    return settings


def resolve_device(requested: str) -> str:
    """ "auto" -> "cuda" when the Ray cluster arctic-rl joins has real GPUs, else "cpu".

    verl's worker holds no GPU itself, so it asks the cluster; a CPU-only torch
    build means the "GPUs" there are stand-ins declared at ``ray.init``.
    """
    if requested in ("cuda", "cpu"):
        return requested
    if requested != "auto":
        raise UnsupportedVerlSetting(f"{ARCTIC}.device", requested, '"auto", "cuda" or "cpu"')
    from arctic_rl_core.server.ray_cluster import cluster_device
    from arctic_rl_verl.cpu_platform import cpu_only_torch

    return "cpu" if cpu_only_torch() else cluster_device()


def micro_batch_spec(arctic) -> dict:
    """verl's micro-batch sizes as arctic's ``mb_spec``: memory only, the loss does not depend on them.

    verl's worker fills the actor's engine config from the actor and rollout sections: under
    ``use_dynamic_bsz`` token budgets per GPU for training (``ppo_max_token_len_per_gpu``) and for
    log-probs (``rollout.log_prob_max_token_len_per_gpu``), else rows per GPU for training
    (``ppo_micro_batch_size_per_gpu``) and for log-probs (``rollout.log_prob_micro_batch_size_per_gpu``).
    The actor's config starts the deployment, so its log-prob bound serves the reference log-probs too.
    ``micro_batch_max_tokens``, when set, replaces them all.
    """
    if arctic.micro_batch_max_tokens is not None:
        return {"max_tokens_per_mb": arctic.micro_batch_max_tokens}
    if arctic.use_dynamic_bsz:
        spec = {"max_tokens_per_mb": arctic.max_token_len_per_gpu}
        if arctic.infer_max_token_len_per_gpu is not None:
            spec["max_tokens_per_forward_mb"] = arctic.infer_max_token_len_per_gpu
        return spec
    return {
        "max_rows_per_mb": arctic.micro_batch_size_per_gpu,
        "max_rows_per_forward_mb": arctic.infer_micro_batch_size_per_gpu,
    }


def client_config(arctic, model_config, optim) -> ArcticRLClientConfig:
    """The arctic-rl deployment for the arctic settings, verl's model and verl's optimizer settings."""
    training_config = {
        "optimizer": optimizer_settings(optim, arctic.optimizer_steps_per_training_step),
        "dtype": arctic.dtype,
        "gradient_checkpointing": arctic.gradient_checkpointing,
        "mb_spec": micro_batch_spec(arctic),
        "zorro_train": {"enable": arctic.zorro_train},
    }
    sampler = {
        "max_model_len": arctic.max_model_len,
        "max_num_seqs": arctic.max_num_seqs,
        "gpu_memory_utilization": arctic.gpu_memory_utilization,
        "enable_prefix_caching": arctic.enable_prefix_caching,
        "logprobs_mode": arctic.logprobs_mode,
    }
    return ArcticRLClientConfig(
        model_name=model_config.local_path or model_config.path,
        comm_protocol=arctic.comm_protocol,
        checkpoint_path=arctic.checkpoint_path,
        training_gpus=arctic.training_gpus,
        sampling_gpus=arctic.sampling_gpus,
        log_prob_gpus=arctic.log_prob_gpus,
        log_prob_engine=arctic.log_prob_engine,
        colocate=arctic.colocate,
        device=resolve_device(arctic.device),
        sampling_engine=arctic.sampling_engine,
        training_config=training_config,
        ds_config=dict(arctic.ds_config),
        vllm_config={key: value for key, value in sampler.items() if value is not None},
        arctic_inference_config={"use_fca": arctic.zorro_inference},
        seed=arctic.seed,
        full_determinism=arctic.full_determinism,
        server_logs=arctic.server_logs,
        startup_timeout=arctic.startup_timeout,
        job_ready_timeout=arctic.job_ready_timeout,
    )
