"""Configuration models: validated once, at the edge, then trusted inside.

``ArcticRLClientConfig`` and ``WeightSyncConfig`` implement the configuration
reference in the seeds field for field. ``TrainingConfig`` is how the server
reads the free-form ``training_config`` dict (extra fields are ignored there,
as the reference says).
"""

from __future__ import annotations

import socket
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_HTTP_PORT = 7000
RECONNECT_ENV = "ARCTIC_RL_RECONNECT_CONFIG"

Backend = Literal["local", "dss-platform", "remote"]
CommProtocol = Literal["http", "ray"]
Device = Literal["auto", "cuda", "cpu"]
SamplingEngineName = Literal["auto", "native", "vllm"]
LogProbEngineName = Literal["vllm", "deepspeed"]


def primary_ip() -> str:
    """The IP this node uses to reach other hosts, so off-node Ray workers can reach our server.

    Connecting a UDP socket sends no packet; it only asks the kernel for the
    route's source address. Without a route we fall back to loopback.
    """
    for target in ("10.255.255.255", "8.8.8.8"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 1))
                return s.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"


class ArcticRLClientConfig(BaseModel):
    """Everything a client needs to start or reach an arctic-rl deployment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    # Backend & communication
    backend: Backend = Field(
        "local",
        description='Backend platform for job execution. "local" starts a server on this node; '
        '"dss-platform" (alias "remote") connects to a server started with `arctic-rl serve`.',
    )
    comm_protocol: CommProtocol = Field("http", description="Communication protocol between client and server.")
    host: Optional[str] = Field(None, description="Server hostname. Auto-derived from comm_protocol unless set.")
    port: Optional[int] = Field(None, ge=1, le=65535, description="Server port. Auto-derived unless set.")

    # Model & checkpoint
    model_name: str = Field(..., min_length=1, description="Model name or HuggingFace ID to load on all engines.")
    checkpoint_path: Optional[str] = Field(None, description="Path to model checkpoint for resuming training.")

    # Engine configuration
    ds_config: dict = Field(default_factory=dict, description="DeepSpeed configuration for the training engine.")
    training_config: Optional[dict] = Field(
        None,
        description="Training worker config: optimizer, dtype, gradient_checkpointing, attn_impl, mb_spec, "
        "zorro_train. Extra fields are ignored by the server.",
    )
    vllm_config: Optional[dict] = Field(None, description="Overrides for the sampling and log-prob engines.")
    log_prob_ds_config: Optional[dict] = Field(None, description="Log-prob DeepSpeed worker configuration.")
    ds_worker_config: Optional[dict] = Field(None, description="DeepSpeed worker configuration (optimizer, dtype).")
    arctic_inference_config: Optional[dict] = Field(None, description="Arctic inference config (use_fca, ...).")

    # GPU resources
    training_gpus: int = Field(0, ge=0, description="GPUs for the DeepSpeed training engine.")
    sampling_gpus: int = Field(0, ge=0, description="GPUs for the sampling engine.")
    log_prob_gpus: int = Field(0, ge=0, description="GPUs for the log-prob engine.")
    log_prob_engine: LogProbEngineName = Field("vllm", description="Engine backend for the log-prob job.")
    colocate: bool = Field(False, description="Colocate all jobs on the same GPUs with fractional Ray resources.")

    # Training & determinism
    full_determinism: bool = Field(False, description="Call enable_full_determinism() for reproducible training.")
    seed: int = Field(42, description="Seed used by enable_full_determinism() when full_determinism=True.")

    # Ray cluster & startup
    ray_auto_attach: bool = Field(True, description="Attach to a running Ray cluster that has GPU resources.")
    server_logs: bool = Field(True, description="Display server subprocess stdout/stderr.")
    startup_timeout: float = Field(300.0, gt=0, description="Seconds to wait for the local server to be healthy.")
    health_check_interval: float = Field(2.0, gt=0, description="Seconds between health-check polls at startup.")
    job_ready_timeout: float = Field(600.0, gt=0, description="Seconds to wait for each job to reach RUNNING.")

    # Reconnection (never forwarded to /initialize)
    training_job_id: Optional[int] = Field(None, description="Existing training job to reconnect to.")
    sampling_job_id: Optional[int] = Field(None, description="Existing sampling job to reconnect to.")
    log_prob_job_id: Optional[int] = Field(None, description="Existing log-prob job to reconnect to.")

    # Our additions
    device: Device = Field(
        "auto",
        description='"cuda", "cpu", or "auto" (CUDA when available). On CPU each "GPU" is one worker process '
        "and collectives use gloo.",
    )
    sampling_engine: SamplingEngineName = Field(
        "auto", description='"vllm", "native", or "auto": vLLM where it imports and supports the device, else native.'
    )
    auth_token: Optional[str] = Field(
        None, description="Bearer token for the HTTP server. The local backend generates one when unset."
    )
    ray_namespace: str = Field("arctic-rl", description="Ray namespace of the server actor (Ray protocol).")
    weight_sync_config: Optional[dict] = Field(
        None, description="WeightSyncConfig fields; bucket_size also sizes the colocated CUDA-IPC buckets."
    )
    ray_server_name: Optional[str] = Field(
        None, description="Name of the Ray server actor to reach; the local backend names the one it starts."
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_alias(cls, value: Any) -> Any:
        return "dss-platform" if value == "remote" else value

    @model_validator(mode="after")
    def _check(self) -> "ArcticRLClientConfig":
        if self.backend == "local" and not self.reconnecting:
            if max(self.training_gpus, self.sampling_gpus, self.log_prob_gpus) <= 0:
                raise ValueError(
                    'backend="local" needs at least one of training_gpus, sampling_gpus or log_prob_gpus > 0 '
                    "(or job ids to reconnect to)"
                )
        if self.comm_protocol == "http":
            if self.host is None:
                self.host = primary_ip()
            if self.port is None:
                self.port = DEFAULT_HTTP_PORT
        return self

    @property
    def reconnecting(self) -> bool:
        """True when job ids are given: the client attaches to them and sends no /initialize."""
        return any(i is not None for i in (self.training_job_id, self.sampling_job_id, self.log_prob_job_id))

    @classmethod
    def reconnect_config(cls, source: Optional[str] = None) -> "ArcticRLClientConfig":
        """The reconnect config a client published for its child processes (or ``source``: JSON or a file path).

        Every client exports its reconnect config in ``ARCTIC_RL_RECONNECT_CONFIG``,
        so processes it starts (data workers, reward servers, Ray workers) attach to
        the same jobs with ``ArcticRLClientConfig.reconnect_config()``.
        """
        import json
        import os
        from pathlib import Path

        text = source if source is not None else os.environ.get(RECONNECT_ENV)
        if not text:
            raise ValueError(
                f"no reconnect config: pass one, or create a client first (it sets {RECONNECT_ENV}); "
                "in the client's own process use client.reconnect_config()"
            )
        if not text.lstrip().startswith("{"):
            text = Path(text).read_text()
        return cls.model_validate(json.loads(text))

    def for_initialize(self) -> "ArcticRLClientConfig":
        """The copy sent to /initialize: job ids and the auth token are never forwarded."""
        return self.model_copy(
            update={"training_job_id": None, "sampling_job_id": None, "log_prob_job_id": None, "auth_token": None}
        )


class WeightSyncConfig(BaseModel):
    """NCCL weight-transfer topology between training ranks and inference replicas."""

    model_config = ConfigDict(extra="forbid")

    training_sharding: Literal["dp", "fsdp"] = Field("dp", description='"dp" or "fsdp" (ZeRO-3 style sharding).')
    training_gpus: int = Field(1, ge=1, description="Number of training GPUs.")
    inference_replicas: int = Field(1, ge=1, description="Number of inference replicas.")
    inference_tp: int = Field(1, ge=1, description="Tensor parallelism degree of each inference replica.")
    base_port: int = Field(29500, ge=1, le=65535, description="Base port for NCCL communication.")
    bucket_size: int = Field(256 * 1024 * 1024, ge=1024, description="Bucket size for weight sync in bytes.")
    timeout_s: float = Field(300.0, gt=0, description="Timeout of every collective; a dead peer raises, never hangs.")


class OptimizerConfig(BaseModel):
    """The optimizer (AdamW by default) and its learning-rate schedule."""

    model_config = ConfigDict(extra="ignore")

    name: Literal["adamw", "sgd"] = Field(
        "adamw", description='"sgd" (plain, no momentum) makes an update exactly -lr * gradient: useful to inspect.'
    )
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    gradient_clipping: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    no_decay_params: Optional[list[str]] = Field(
        None,
        description="Names of the parameters weight decay skips. None: every parameter of fewer than 2 dimensions "
        "(biases, norm weights); [] decays all, as verl's and SkyRL's AdamW do. The TRL adapter passes HF "
        "Trainer's choice.",
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps_proportion: Optional[float] = Field(None, ge=0, le=1)
    warmup_ratio: Optional[float] = Field(None, ge=0, le=1, description="Alias of warmup_steps_proportion.")
    warmup_steps: Optional[int] = Field(
        None, ge=0, description="Warmup length in schedule steps; overrides warmup_steps_proportion."
    )
    total_train_steps: int = Field(
        1000,
        ge=1,
        description="Horizon of warmup and of linear/cosine decay, in schedule steps: set it to your run's length.",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Floor of linear/cosine decay, as a fraction of lr.")
    lr_schedule_interval: int = Field(
        1,
        ge=1,
        description="Optimizer steps per schedule step. verl advances its schedule once per training step, over "
        "all of that step's mini-batches: its adapter sets this to the optimizer steps per training step.",
    )

    @property
    def num_warmup_steps(self) -> int:
        """Warmup length in schedule steps: ``warmup_steps``, else the proportion of ``total_train_steps``."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        fraction = self.warmup_steps_proportion if self.warmup_steps_proportion is not None else self.warmup_ratio
        return int(round((fraction or 0.0) * self.total_train_steps))


class MicroBatchSpec(BaseModel):
    """How a call's rows are split into micro-batches. None of these changes a loss or its gradients: they bound memory.

    Each micro-batch holds at most ``max_tokens_per_mb`` tokens (rows x longest row) and at most
    ``max_rows_per_mb`` rows. Forward-only calls (``fwd_no_grad``, reference log-probs) keep the same
    bounds, except that ``max_tokens_per_forward_mb`` and ``max_rows_per_forward_mb``, when set, replace
    them for those calls: a forward keeps no activations for a backward, so it can afford larger
    micro-batches (as verl's ``log_prob_max_token_len_per_gpu`` and ``log_prob_micro_batch_size_per_gpu``,
    and SkyRL's ``micro_forward_batch_size_per_gpu``). ``n_mbs`` is for ``fwd_bwd`` only.
    """

    model_config = ConfigDict(extra="ignore")

    max_tokens_per_mb: Optional[int] = Field(None, ge=1, description="None: one micro-batch per call.")
    n_mbs: Optional[int] = Field(None, ge=1, description="Minimum number of micro-batches.")
    max_rows_per_mb: Optional[int] = Field(None, ge=1, description="None: no bound on a micro-batch's rows.")
    max_tokens_per_forward_mb: Optional[int] = Field(None, ge=1, description="None: max_tokens_per_mb.")
    max_rows_per_forward_mb: Optional[int] = Field(None, ge=1, description="None: max_rows_per_mb.")

    @property
    def forward_max_tokens(self) -> Optional[int]:
        return self.max_tokens_per_forward_mb or self.max_tokens_per_mb

    @property
    def forward_max_rows(self) -> Optional[int]:
        return self.max_rows_per_forward_mb or self.max_rows_per_mb


class ZorroTrainConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    enable: bool = False
    min_shared_tokens: int = Field(16, ge=1, description="Shorter shared prefixes are not worth packing.")


class TrainingConfig(BaseModel):
    """The server's reading of ``training_config``; unknown keys are ignored, as the seeds say."""

    model_config = ConfigDict(extra="ignore")

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False
    cuda_graphs: bool = Field(
        False,
        description="Replay the decoder layers' forward and backward in fwd_bwd as CUDA graphs when a batch's "
        "shape repeats (captured on its second sight). For small, host-bound steps; CUDA only, not under "
        "ZeRO-3 or gradient checkpointing. Graph memory pools are kept until the engine sleeps.",
    )
    attn_impl: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    mb_spec: MicroBatchSpec = Field(default_factory=MicroBatchSpec)
    zorro_train: ZorroTrainConfig = Field(default_factory=ZorroTrainConfig)
    default_loss: str = Field("sft", description="Loss used when fwd_bwd gets processing=None.")
    default_loss_config: dict = Field(default_factory=dict)
