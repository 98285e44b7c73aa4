"""The ``trainer.arctic_rl`` block of a SkyRL config, and the ``ArcticRLClientConfig`` a run derives from it.

SkyRL's config is strict (unknown keys are errors), so the block is a field of
a ``TrainerConfig`` subclass; ``ArcticSkyRLTrainConfig`` is SkyRL's root config
with that trainer. Fields left ``None`` are derived from the settings SkyRL
already has (GPU counts, colocation, dtype, optimizer), so a run needs no
arctic settings at all; a user overrides any of them as one flag,
``trainer.arctic_rl={colocate: true, zorro_train: true}``, or key by key,
``trainer.arctic_rl.sampler=native``.
"""

# No `from __future__ import annotations`: SkyRL builds nested configs from real field types.
from dataclasses import dataclass, field
from typing import Optional

from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.config.config import BaseConfig, TrainerConfig, make_config

from arctic_rl_core import ArcticRLClientConfig

SAMPLERS = ("auto", "native", "vllm")
DEVICES = ("auto", "cuda", "cpu")
PROTOCOLS = ("ray", "http")
LOG_PROB_ENGINES = ("deepspeed", "vllm")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flex_attention")

# SkyRL scheduler names (HF's ``get_scheduler``) arctic's optimizer knows; warmup comes from
# optimizer_config.num_warmup_steps, except for "constant", which ignores it in HF too.
_SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}


@dataclass
class ArcticRLConfig(BaseConfig):
    """Where arctic-rl runs the work SkyRL's FSDP workers and vLLM engines would do. ``None``: derived."""

    training_gpus: Optional[int] = None
    """GPUs of the DeepSpeed training engine. None: ``trainer.placement.policy_num_gpus_per_node * policy_num_nodes``."""
    sampling_gpus: Optional[int] = None
    """GPUs of the sampling engine. None: ``generator.inference_engine.num_engines * tensor_parallel_size``."""
    log_prob_gpus: Optional[int] = None
    """GPUs of the reference log-prob engine. None: ``training_gpus`` when SkyRL needs a reference model
    (``use_kl_loss`` or ``use_kl_in_reward``), else 0."""
    colocate: Optional[bool] = None
    """Share devices between the engines. None: ``trainer.placement.colocate_all``."""
    zorro_train: bool = False
    """ZoRRo Train: each shared prompt prefix is computed once per micro-batch (exact; faster on GRPO groups)."""
    zorro_inference: bool = True
    """ZoRRo Inference: Forest Cascade Attention over shared KV-cache prefixes in decode."""
    sampler: str = "auto"
    """Sampling engine: "vllm", "native" (arctic's own), or "auto" (vLLM where it imports on CUDA, else native)."""
    log_prob_engine: str = "deepspeed"
    """Reference log-probs from a forward-only DeepSpeed engine (the training engine's numerics) or "vllm"."""
    device: str = "auto"
    """"cuda", "cpu" (every "GPU" is a CPU worker process), or "auto"."""
    comm_protocol: str = "ray"
    """How the trainer reaches the arctic server: "ray" (an actor in SkyRL's Ray cluster) or "http"."""
    ray_auto_attach: bool = True
    """Join a running Ray cluster that offers GPUs (``ray start --head``) instead of starting a local one."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage of the training engine (0-3)."""
    offload_optimizer: bool = False
    """Keep the optimizer state on the CPU (ZeRO stage >= 1)."""
    attn_impl: str = "sdpa"
    """Attention kernel of the training and log-prob engines: sdpa, eager, flash_attention_2, flex_attention."""
    cuda_ipc_weight_sync: bool = False
    """Colocated on CUDA: sync weights by CUDA IPC instead of through a file."""
    sampler_config: dict = field(default_factory=dict)
    """Extra sampling-engine options (arctic's ``vllm_config``), e.g. ``{max_num_seqs: 64}``."""
    server_logs: bool = False
    """Show the arctic server's and workers' logs."""
    job_ready_timeout: float = 900.0
    """Seconds each arctic job may take to start."""

    def __post_init__(self) -> None:
        _check_choice("sampler", self.sampler, SAMPLERS)
        _check_choice("log_prob_engine", self.log_prob_engine, LOG_PROB_ENGINES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("comm_protocol", self.comm_protocol, PROTOCOLS)
        _check_choice("attn_impl", self.attn_impl, ATTENTION)
        for name in ("training_gpus", "sampling_gpus", "log_prob_gpus"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"trainer.arctic_rl.{name} must be a non-negative integer or null, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.arctic_rl.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("trainer.arctic_rl.offload_optimizer=true needs trainer.arctic_rl.zero_stage >= 1")
        if not isinstance(self.sampler_config, dict):
            raise ValueError(f"trainer.arctic_rl.sampler_config must be a mapping, got {self.sampler_config!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"trainer.arctic_rl.{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class ArcticTrainerConfig(TrainerConfig):
    """SkyRL's trainer config plus the arctic block."""

    arctic_rl: ArcticRLConfig = field(default_factory=ArcticRLConfig)


ArcticSkyRLTrainConfig = make_config(trainer_cls=ArcticTrainerConfig)
"""SkyRL's root config with ``trainer.arctic_rl``; the entrypoint parses the command line with it."""


@dataclass(frozen=True)
class Placement:
    """The arctic block with every derived field resolved against the rest of the SkyRL config."""

    training_gpus: int
    sampling_gpus: int
    log_prob_gpus: int
    colocate: bool

    @property
    def cluster_gpus(self) -> int:
        counts = (self.training_gpus, self.sampling_gpus, self.log_prob_gpus)
        return max(counts) if self.colocate else sum(counts)


def needs_reference(cfg: SkyRLTrainConfig) -> bool:
    """Whether SkyRL computes reference log-probs (KL in the loss or in the reward)."""
    algorithm = cfg.trainer.algorithm
    return bool(algorithm.use_kl_loss or algorithm.use_kl_in_reward)


def placement(cfg: SkyRLTrainConfig) -> Placement:
    arctic: ArcticRLConfig = cfg.trainer.arctic_rl
    trainer_placement = cfg.trainer.placement
    engine = cfg.generator.inference_engine
    training = arctic.training_gpus
    if training is None:
        training = trainer_placement.policy_num_gpus_per_node * trainer_placement.policy_num_nodes
    sampling = arctic.sampling_gpus
    if sampling is None:
        sampling = engine.num_engines * engine.tensor_parallel_size
    log_prob = arctic.log_prob_gpus
    if log_prob is None:
        log_prob = training if needs_reference(cfg) else 0
    if training < 1 or sampling < 1:
        raise ValueError(
            f"arctic-rl needs at least one training and one sampling GPU, got training_gpus={training}, "
            f"sampling_gpus={sampling} (set trainer.arctic_rl.training_gpus / sampling_gpus)"
        )
    if needs_reference(cfg) and log_prob < 1:
        raise ValueError(
            "trainer.algorithm.use_kl_loss / use_kl_in_reward need reference log-probs, but "
            "trainer.arctic_rl.log_prob_gpus=0; give the log-prob engine a GPU or turn the KL off"
        )
    colocate = trainer_placement.colocate_all if arctic.colocate is None else arctic.colocate
    return Placement(training, sampling, log_prob, bool(colocate))


def longest_prompt(cfg: SkyRLTrainConfig) -> int:
    """The longest prompt SkyRL's generator sends the sampler.

    A dataset prompt has at most ``trainer.max_prompt_length`` tokens; a turn of
    the multi-turn agent loop is sent while its input (prompt, earlier turns and
    observations) is at most ``generator.max_input_length`` (which defaults to
    ``max_prompt_length``), each turn with ``max_tokens=max_generate_length``.
    """
    return max(cfg.generator.max_input_length or 0, cfg.trainer.max_prompt_length)


def longest_sequence(cfg: SkyRLTrainConfig) -> int:
    """The widest row a SkyRL training batch can have (``convert_prompts_responses_to_batch_tensors`` pads to it).

    The longest prompt and a full generation; SkyRL's agent loop drops the last
    observation, and appends one EOS after a stop string when
    ``append_eos_token_after_stop_str_in_multi_turn`` and
    ``use_conversation_multi_turn`` hold (not in ``batched`` generation).
    Step-wise trajectories keep each step's observation, which nothing bounds.
    """
    generator = cfg.generator
    appended_eos = bool(
        generator.sampling_params.stop
        and generator.append_eos_token_after_stop_str_in_multi_turn
        and generator.use_conversation_multi_turn
        and not generator.batched
    )
    return longest_prompt(cfg) + generator.sampling_params.max_generate_length + int(appended_eos)


def optimizer_steps(cfg: SkyRLTrainConfig, training_batches: int) -> int:
    """Optimizer steps of the whole run: one per policy mini-batch, per update epoch, per training batch."""
    trainer = cfg.trainer
    mini_batches = trainer.train_batch_size // trainer.policy_mini_batch_size
    return max(1, training_batches * mini_batches * trainer.update_epochs_per_batch)


def client_config(
    cfg: SkyRLTrainConfig, total_optimizer_steps: int, checkpoint_path: Optional[str] = None
) -> ArcticRLClientConfig:
    """The arctic client config of a SkyRL run: placement, engines, optimizer and schedule, micro-batching."""
    arctic: ArcticRLConfig = cfg.trainer.arctic_rl
    trainer = cfg.trainer
    where = placement(cfg)
    optimizer = trainer.policy.optimizer_config
    scheduler = _SCHEDULERS.get(optimizer.scheduler)
    if scheduler is None:
        raise ValueError(
            f"trainer.policy.optimizer_config.scheduler={optimizer.scheduler!r} has no arctic-rl equivalent; "
            f"use one of {', '.join(_SCHEDULERS)}"
        )
    beta1, beta2 = optimizer.adam_betas
    dtype = "bfloat16" if trainer.bf16 else "float32"
    training_config = {
        "dtype": dtype,
        "gradient_checkpointing": trainer.gradient_checkpointing,
        "attn_impl": arctic.attn_impl,
        "optimizer": {
            "lr": optimizer.lr,
            "weight_decay": optimizer.weight_decay,
            "beta1": beta1,
            "beta2": beta2,
            "gradient_clipping": optimizer.max_grad_norm,
            "lr_scheduler_type": scheduler,
            "total_train_steps": total_optimizer_steps,
            "warmup_steps": 0 if optimizer.scheduler == "constant" else optimizer.num_warmup_steps,
            # SkyRL's FSDP AdamW decays every parameter, biases and norm weights included.
            "no_decay_params": [],
        },
        "mb_spec": _micro_batch_spec(cfg),
        "zorro_train": {"enable": arctic.zorro_train},
    }
    ds_config: dict = {"zero_optimization": {"stage": arctic.zero_stage}}
    if arctic.offload_optimizer:
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine = cfg.generator.inference_engine
    sampler_config = {
        "max_model_len": longest_prompt(cfg) + cfg.generator.sampling_params.max_generate_length,
        "max_num_seqs": engine.max_num_seqs,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "enforce_eager": engine.enforce_eager,
        # As SkyRL applies them: last, over the engine arguments it derives (arctic's own options win).
        **engine.engine_init_kwargs,
        **arctic.sampler_config,
    }
    return ArcticRLClientConfig(
        backend="local",
        comm_protocol=arctic.comm_protocol,
        model_name=trainer.policy.model.path,
        checkpoint_path=checkpoint_path,
        ds_config=ds_config,
        training_config=training_config,
        log_prob_ds_config={"dtype": dtype, "attn_impl": arctic.attn_impl},
        vllm_config=sampler_config,
        arctic_inference_config={"use_fca": arctic.zorro_inference},
        training_gpus=where.training_gpus,
        sampling_gpus=where.sampling_gpus,
        log_prob_gpus=where.log_prob_gpus,
        log_prob_engine=arctic.log_prob_engine,
        colocate=where.colocate,
        seed=trainer.seed,
        device=arctic.device,
        sampling_engine=arctic.sampler,
        ray_auto_attach=arctic.ray_auto_attach,
        server_logs=arctic.server_logs,
        job_ready_timeout=arctic.job_ready_timeout,
    )


def _micro_batch_spec(cfg: SkyRLTrainConfig) -> dict:
    """SkyRL's micro-batching knobs as arctic's: a token budget, or its rows per micro-batch for training and forwards.

    Neither changes the loss or its gradients (arctic normalizes by the whole call); they bound memory.
    """
    trainer = cfg.trainer
    if trainer.max_tokens_per_microbatch > 0:
        return {"max_tokens_per_mb": trainer.max_tokens_per_microbatch}
    return {
        "max_rows_per_mb": trainer.micro_train_batch_size_per_gpu,
        "max_rows_per_forward_mb": trainer.micro_forward_batch_size_per_gpu,
    }
