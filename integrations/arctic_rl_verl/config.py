"""The arctic settings as verl config dataclasses, built by the ``model_engine=arctic`` Hydra group.

``conf/actor/arctic_actor.yaml`` instantiates :class:`ArcticActorConfig` for
``actor_rollout_ref.actor``. verl instantiates the actor config in the driver
(``validate_config`` in ``main_ppo``) before Ray starts, so its
``__post_init__`` is where an unsupported verl setting fails, at startup,
naming the setting. The engine receives :class:`ArcticEngineConfig`, which
carries both the arctic deployment (GPU split, colocation, ZoRRo, sampler)
and the verl loss settings already translated into the ``grpo`` processor's
config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, get_args

from verl.workers.config import ActorConfig
from verl.workers.config.engine import EngineConfig

from arctic_rl_core.config import CommProtocol, Device, LogProbEngineName, SamplingEngineName, TrainingConfig
from arctic_rl_verl.mapping import (
    ARCTIC,
    check_run,
    optimizer_settings,
    optimizer_steps_per_training_step,
    policy_loss,
)

STRATEGY = "arctic"


@dataclass
class ArcticEngineConfig(EngineConfig):
    """Where and how arctic-rl runs what verl asks of its actor, reference and rollout.

    Deployment:
        comm_protocol: "ray" (the arctic server joins verl's Ray cluster) or "http"
            (a server subprocess with a Ray cluster of its own).
        device: "auto" ("cuda" when the Ray cluster has real GPUs, else "cpu"), "cuda" or "cpu".
        training_gpus, sampling_gpus, log_prob_gpus: arctic-rl's GPU split. A
            reference policy (KL loss or KL in reward) needs log_prob_gpus >= 1.
        colocate: share the GPUs between the engines (fractional Ray resources).
        sampling_engine: "vllm", "native" or "auto" (vLLM where it imports on CUDA).
        log_prob_engine: "deepspeed" or "vllm" for the reference log-probs.
        zorro_train: pack shared prompts once in training forward/backward (ZoRRo Train).
        zorro_inference: Forest Cascade Attention in decode (ZoRRo Inference).
        ds_config: DeepSpeed config of the training engine (e.g. zero_optimization).
        micro_batch_max_tokens: token budget of one micro-batch, replacing verl's micro-batch
            sizes (memory only: arctic-rl normalizes over the whole call, so the loss does not
            depend on it). None: verl's own, as ``mapping.micro_batch_spec`` maps them.
        gradient_checkpointing: recompute activations in backward.
        max_model_len, max_num_seqs, gpu_memory_utilization, enable_prefix_caching: sampler.
        generate_batch_window_s: how long the rollout server gathers concurrent verl
            requests into one arctic generate call.
        checkpoint_path: the checkpoint the training job resumes from when it starts:
            ``<trainer.default_local_dir>/global_step_<N>/actor``, the directory holding
            DeepSpeed's ``latest`` (a new or empty directory starts fresh).
        startup_timeout, job_ready_timeout, server_logs: as in ArcticRLClientConfig.

    Filled from verl's actor settings by :class:`ArcticActorConfig`:
        loss_config: the ``grpo`` processor config (see ``mapping.policy_loss``).
        decoupled_ppo: feed verl's rollout log-probs as the behaviour policy (TIS).
        logprobs_mode: what the sampler's log-probs score, verl's ``rollout.logprobs_mode``.
        optimizer_steps_per_training_step: scales verl's LR horizon to arctic's optimizer steps.
    """

    strategy: str = STRATEGY
    comm_protocol: str = "ray"
    device: str = "auto"
    training_gpus: int = 1
    sampling_gpus: int = 1
    log_prob_gpus: int = 0
    colocate: bool = True
    sampling_engine: str = "auto"
    log_prob_engine: str = "deepspeed"
    zorro_train: bool = False
    zorro_inference: bool = True
    ds_config: dict = field(default_factory=dict)
    micro_batch_max_tokens: Optional[int] = None
    gradient_checkpointing: bool = False
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    generate_batch_window_s: float = 0.05
    checkpoint_path: Optional[str] = None
    startup_timeout: float = 600.0
    job_ready_timeout: float = 1200.0
    server_logs: bool = True
    loss_config: dict = field(default_factory=dict)
    decoupled_ppo: bool = False
    logprobs_mode: str = "processed_logprobs"
    optimizer_steps_per_training_step: int = 1

    def __post_init__(self):
        super().__post_init__()
        choices = {
            "comm_protocol": get_args(CommProtocol),
            "device": get_args(Device),
            "sampling_engine": get_args(SamplingEngineName),
            "log_prob_engine": get_args(LogProbEngineName),
            "dtype": get_args(TrainingConfig.model_fields["dtype"].annotation),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{ARCTIC}.{name}={getattr(self, name)!r}: expected one of {list(allowed)}")
        # The actor trains and the rollout samples: both jobs must exist.
        for name, least in (("training_gpus", 1), ("sampling_gpus", 1), ("log_prob_gpus", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{ARCTIC}.{name}={getattr(self, name)}: expected at least {least}")
        if self.generate_batch_window_s < 0:
            raise ValueError(f"{ARCTIC}.generate_batch_window_s={self.generate_batch_window_s}: expected >= 0 seconds")


@dataclass
class ArcticActorConfig(ActorConfig):
    """``actor_rollout_ref.actor`` with the arctic backend.

    Args:
        arctic: the arctic settings (the engine config).
        verl_settings: the settings outside the actor section that decide whether
            arctic-rl can serve this run (advantage estimator, rollout, trainer
            mode, ...), interpolated from where verl keeps them.
    """

    strategy: str = STRATEGY
    arctic: ArcticEngineConfig = field(default_factory=ArcticEngineConfig)
    verl_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        _bind_engine(self)
        check_run(self, self.verl_settings)
        loss = policy_loss(self, self.verl_settings)
        steps = optimizer_steps_per_training_step(self, self.verl_settings)
        optimizer_settings(self.optim, steps)
        object.__setattr__(self.arctic, "loss_config", loss.config)
        object.__setattr__(self.arctic, "decoupled_ppo", loss.decoupled)
        object.__setattr__(self.arctic, "logprobs_mode", self.verl_settings["rollout_logprobs_mode"])
        object.__setattr__(self.arctic, "optimizer_steps_per_training_step", steps)


@dataclass
class ArcticRefConfig(ActorConfig):
    """``actor_rollout_ref.ref`` with the arctic backend: the reference log-probs of arctic's log-prob engine."""

    strategy: str = STRATEGY
    arctic: ArcticEngineConfig = field(default_factory=ArcticEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        self.arctic.forward_only = True
        _bind_engine(self)


def _bind_engine(config: ActorConfig) -> None:
    if config.strategy != STRATEGY:
        raise ValueError(
            f"{type(config).__name__}.strategy={config.strategy!r}: the model_engine=arctic config group "
            f"runs only the {STRATEGY!r} strategy"
        )
    config.engine = config.arctic
    # verl reads the backend from engine_config.strategy.
    object.__setattr__(config.arctic, "strategy", config.strategy)
