"""The operation table: every operation arctic-rl serves, written down once.

Each ``Op`` names a method, the request model that validates its arguments at
the edge, and the job it runs on. The HTTP routes (``server/http_app.py``), the
Ray server (``server/ray_server.py``) and both clients (``client/base.py``) are
derived from this table, so they cannot drift apart.

Requests route themselves: fields ending in ``_job_id`` are routing fields. A
client fills them from the job ids it holds (users never pass them), and the
server resolves them to jobs. Everything else is the operation's payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Callable, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema, model_validator

from arctic_rl_core.config import ArcticRLClientConfig
from arctic_rl_core.engines.sampling.protocol import SamplingParams


class JobKind(str, Enum):
    TRAINING = "training"
    SAMPLING = "sampling"
    LOG_PROB = "log_prob"

    @property
    def id_field(self) -> str:
        return f"{self.value}_job_id"


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)):
        try:
            return torch.tensor(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"expected a rectangular array of numbers: {exc}") from None
    raise ValueError(f"expected a tensor (or a nested list of numbers), got {type(value).__name__}")


Tensor = Annotated[
    torch.Tensor,
    BeforeValidator(_as_tensor),
    PlainSerializer(lambda t: t, return_type=Any),
    WithJsonSchema({"type": "array", "items": {}, "description": "tensor (wire format) or nested number lists"}),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


# ---------------------------------------------------------------- batches


class Batch(_Request):
    """A model batch: ``args[0]`` is input_ids [B, T]; kwargs hold attention_mask; context holds RL tensors.

    Context keys (all optional per loss; shapes checked here, meaning checked by the loss):
    ``advantages`` [B] or [B, T]; ``response_mask`` [B, T] (unshifted, 1 on response tokens) or
    ``loss_mask_shifted`` [B, T]; ``old_log_probs_shifted``, ``prox_logp_shifted``,
    ``ref_log_probs_shifted`` [B, T], in the ``torch.roll(input_ids, -1)`` layout.
    """

    args: list[Tensor] = Field(..., min_length=1, max_length=1, description="[input_ids] of shape [B, T].")
    kwargs: dict[str, Tensor] = Field(default_factory=dict, description="attention_mask [B, T] (default: all ones).")
    context: dict[str, Tensor] = Field(default_factory=dict, description="RL tensors in the shifted layout.")

    @model_validator(mode="after")
    def _check_shapes(self) -> "Batch":
        input_ids = self.args[0]
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(
                f"batch.args[0] (input_ids): expected an integer tensor [B, T], got {input_ids.dtype} "
                f"{list(input_ids.shape)}"
            )
        if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
            raise ValueError(f"batch.args[0] (input_ids): need B >= 1 and T >= 2, got {list(input_ids.shape)}")
        unknown = set(self.kwargs) - {"attention_mask", "position_ids"}
        if unknown:
            raise ValueError(f"batch.kwargs: unsupported keys {sorted(unknown)}; allowed: attention_mask, position_ids")
        shape = tuple(input_ids.shape)
        for name, tensor in self.kwargs.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"batch.kwargs.{name}: expected shape {list(shape)} like input_ids, got {list(tensor.shape)}"
                )
        if "position_ids" in self.kwargs:
            self._check_position_ids()
        for name, tensor in self.context.items():
            if (
                tensor.dim() == 0
                or tensor.shape[0] != shape[0]
                or (tensor.dim() > 1 and tuple(tensor.shape[:2]) != shape)
            ):
                raise ValueError(
                    f"batch.context.{name}: expected [B] or [B, T] = {list(shape)} like input_ids, got {list(tensor.shape)}"
                )
        return self

    def _check_position_ids(self) -> None:
        """The engines take positions from attention_mask; position_ids that say otherwise would be ignored."""
        from arctic_rl_core.models.forward import position_ids_from_mask

        mask = self.kwargs.get("attention_mask")
        if mask is not None and not ((mask == 0) | (mask == 1)).all():
            return  # a mask that is not 0/1 is refused with its own message, where the model is known
        real = self.attention_mask.bool()
        given = self.kwargs["position_ids"]
        differs = (given.long() != position_ids_from_mask(self.attention_mask)) & real
        if differs.any():
            row = int(differs.any(-1).nonzero()[0])
            raise ValueError(
                "batch.kwargs.position_ids: the engines derive positions from attention_mask (each row's real "
                f"tokens at 0, 1, 2, ...); row {row} gives {given[row][real[row]].tolist()[:8]} at its real tokens. "
                "Omit position_ids, or pass one sequence per row (packed sequences are not supported)"
            )

    @property
    def input_ids(self) -> torch.Tensor:
        return self.args[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        mask = self.kwargs.get("attention_mask")
        return torch.ones_like(self.input_ids) if mask is None else mask.to(torch.long)


class Processing(_Request):
    """What to compute on the model outputs: a registered loss (or allowed dotted path) and post-processors."""

    loss_fn: str = Field("grpo", min_length=1, description="Registry name, alias, or allowed dotted path.")
    config: dict = Field(default_factory=dict, description="The loss's own config (validated by the loss).")
    post: list[str | dict] = Field(default_factory=list, description="Post-processors applied to logits.")


# ---------------------------------------------------------------- requests


class FwdBwdRequest(_Request):
    training_job_id: int
    batch: Batch
    processing: Optional[Processing] = Field(None, description="None: the server's default loss.")


class FwdNoGradRequest(_Request):
    training_job_id: Optional[int] = None
    log_prob_job_id: Optional[int] = None
    batch: Batch
    reference_model: bool = Field(True, description="True: the log-prob (reference) job; False: the training job.")
    processing: Optional[Processing] = Field(None, description="Only post-processors (e.g. temperature) are used.")
    return_entropy: bool = False


class StepRequest(_Request):
    training_job_id: int


class SaveCheckpointRequest(_Request):
    training_job_id: int
    path: Optional[str] = Field(None, description="Directory; default: the job's checkpoint_path or ./checkpoints.")


class GenerateRequest(_Request):
    sampling_job_id: int
    prompts: Optional[list[str]] = Field(None, description="Prompt strings (tokenized by the sampler).")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_token_ids: Optional[list[list[int]]] = Field(None, description="Token ids instead of prompts.")

    @model_validator(mode="after")
    def _one_prompt_form(self) -> "GenerateRequest":
        if (self.prompts is None) == (self.prompt_token_ids is None):
            raise ValueError("generate needs exactly one of prompts or prompt_token_ids")
        if self.prompt_token_ids is not None and any(len(p) == 0 for p in self.prompt_token_ids):
            raise ValueError("prompt_token_ids: every prompt needs at least one token")
        return self


class LogProbsRequest(_Request):
    log_prob_job_id: int
    prompts: list[str] = Field(..., min_length=1)
    completions: Optional[list[str]] = None
    top_k: int = Field(1, ge=0, le=100)

    @model_validator(mode="after")
    def _paired(self) -> "LogProbsRequest":
        if self.completions is not None and len(self.completions) != len(self.prompts):
            raise ValueError(
                f"completions: expected {len(self.prompts)} entries (one per prompt), got {len(self.completions)}"
            )
        return self


class SyncWeightsRequest(_Request):
    training_job_id: int
    sampling_job_id: int
    cuda_ipc: bool = Field(False, description="True: zero-copy CUDA IPC (colocated, on GPU); False: CPU file path.")
    low_memory: bool = Field(False, description="CUDA IPC only: stream one bucket at a time.")


class WeightNormRequest(_Request):
    training_job_id: Optional[int] = None
    sampling_job_id: Optional[int] = None
    log_prob_job_id: Optional[int] = None


class SleepInferenceRequest(_Request):
    sampling_job_id: int
    level: Literal[1, 2] = 1


class WakeInferenceRequest(_Request):
    sampling_job_id: int
    tags: Optional[list[Literal["weights", "kv_cache"]]] = None


class SamplingJobRequest(_Request):
    sampling_job_id: int


class SleepTrainingRequest(_Request):
    training_job_id: int
    mode: Literal["all", "non_lp", "lp_params"] = "all"


class TrainingJobRequest(_Request):
    training_job_id: int


class LogProbJobRequest(_Request):
    log_prob_job_id: Optional[int] = None


class InitializeRequest(_Request):
    config: ArcticRLClientConfig = Field(
        ..., description="The client's config; job ids and client-only fields are ignored."
    )


class JobRequest(_Request):
    job_id: int = Field(..., ge=0)


class EmptyRequest(_Request):
    pass


class EchoRequest(_Request):
    payload: Any = Field(None, description="Anything the transport carries (tensors too); returned as is.")


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Op:
    """One operation: client method ``name``, HTTP route ``{http_method} {path}``, job (or server) method ``name``.

    Job ops run on the job their routing field names. Server ops (``server=True``)
    manage jobs and run on the JobManager itself.
    """

    name: str
    request: type[_Request]
    doc: str
    server: bool = False
    http_method: Literal["GET", "POST"] = "POST"
    # Which routing field names the job that runs it; None: the op's single routing field.
    route: Optional[Callable[[Any], JobKind]] = None
    # Returned instead of an error when the job it needs does not exist.
    absent_result: Optional[dict] = None
    # Client-side defaults that depend on where the client runs: (config, arguments) -> arguments.
    client_defaults: Optional[Callable[[Any, dict], dict]] = None

    @property
    def path(self) -> str:
        if self.http_method == "GET" and "job_id" in self.request.model_fields:
            return "/jobs/{job_id}/" + self.name.removeprefix("job_").replace("_", "-")
        return "/" + self.name.replace("_", "-")

    @property
    def routing_fields(self) -> tuple[str, ...]:
        if self.server:
            return ()
        return tuple(f for f in self.request.model_fields if f.endswith("_job_id"))

    @property
    def payload_fields(self) -> tuple[str, ...]:
        return tuple(f for f in self.request.model_fields if f not in self.routing_fields)

    def job_kind(self, request: Any) -> JobKind:
        if self.route is not None:
            return self.route(request)
        (field,) = self.routing_fields
        return JobKind(field.removesuffix("_job_id"))


def _local_checkpoint_dir(config, arguments: dict) -> dict:
    """With a local server, a relative or omitted path means the caller's working directory."""
    import os

    if config.backend != "local":
        return arguments
    path = arguments.get("path") or config.checkpoint_path or "checkpoints"
    return {**arguments, "path": os.path.abspath(path)}


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("fwd_bwd", FwdBwdRequest, "Forward and backward on the training engine; gradients accumulate until step()."),
        Op(
            "fwd_no_grad",
            FwdNoGradRequest,
            "Forward without gradients; returns log_probs_shifted [B, T] (torch.roll(input_ids, -1) layout).",
            route=lambda r: JobKind.LOG_PROB if r.reference_model else JobKind.TRAINING,
        ),
        Op("step", StepRequest, "One optimizer step; returns grad_norm and lr."),
        Op(
            "save_checkpoint",
            SaveCheckpointRequest,
            "Save a resumable training checkpoint (default: checkpoint_path, else ./checkpoints of the caller).",
            client_defaults=_local_checkpoint_dir,
        ),
        Op("generate", GenerateRequest, "Sample completions; returns one result dict per prompt."),
        Op("log_probs", LogProbsRequest, "Per-token log-probs (and top-k alternatives) of prompts/completions."),
        Op("sync_weights", SyncWeightsRequest, "Copy training weights into the sampling engine.", route=lambda r: JobKind.TRAINING),
        Op("weight_norm", WeightNormRequest, "L2 weight norms of the training, sampling and log-prob engines.", route=lambda r: JobKind.TRAINING),
        Op("sleep_inference", SleepInferenceRequest, "Free sampling memory (level 1: KV cache; level 2: weights too)."),
        Op("wake_inference", WakeInferenceRequest, "Restore what sleep_inference freed."),
        Op("reset_prefix_cache", SamplingJobRequest, "Drop the sampling engine's prefix cache."),
        Op("sleep_training", SleepTrainingRequest, "Offload training state to CPU (modes: all, non_lp, lp_params)."),
        Op("wake_training", TrainingJobRequest, "Reload offloaded training state to the GPU."),
        Op("empty_training_cache", TrainingJobRequest, "Release PyTorch's cached GPU memory on all training workers."),
        Op("sleep_log_prob", LogProbJobRequest, "Offload the log-prob engine to CPU.", absent_result={"status": "no_log_prob_job"}),
        Op("wake_log_prob", LogProbJobRequest, "Reload the log-prob engine to the GPU.", absent_result={"status": "no_log_prob_job"}),
        # Server ops: job lifecycle. Clients call them for you.
        Op("initialize", InitializeRequest, "Create the jobs a config asks for; returns their ids.", server=True),
        Op("status", EmptyRequest, "Server and job states.", server=True, http_method="GET"),
        Op("job_status", JobRequest, "One job's state (PENDING, RUNNING, FAILED, DESTROYED) and error.", server=True, http_method="GET"),
        Op("destroy_job", JobRequest, "Stop a job's workers and release its devices.", server=True),
        Op("stop_server", EmptyRequest, "Destroy all jobs and stop the server process.", server=True),
        Op("echo", EchoRequest, "Return the payload: measures the transport (benchmarks/client_overhead.py).", server=True),
    )
}  # fmt: skip
