"""Post-processors: from the logits of the gathered loss rows to log-probs and entropy.

The engine applies the LM head only at the rows a loss reads, so everything
here takes ``logits`` [N, V] (N gathered token rows), not [B, T, V].

``processing["post"]`` composes as follows. Its entries are names or
``{"name": ..., "config": {...}}``. Logit transforms (``temperature``) apply in
the order given. Log-probs and entropy are then computed once, from the
transformed logits, by the engine; they are not steps of the pipeline:

- ``compute_logprobs`` is accepted and changes nothing: every loss reads log-probs.
- ``compute_entropy`` asks for entropy even when the loss does not need it,
  so the ``entropy`` metric is reported.

Log-probs and entropy are computed in float32 chunks of rows with hand-written
backward passes: neither saves a float32 [N, V] tensor for backward, and no
float32 copy of more than one chunk exists at a time. (``log_softmax`` under
autograd keeps its float32 [N, V] output alive until backward, which for a
150k vocabulary is most of a GPU's memory at long sequence lengths.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor
from torch.autograd.function import once_differentiable

from arctic_rl_core.processors.base import PostProcessingError, describe_validation_error

FP32_CHUNK_BYTES = 256 * 1024 * 1024


def _rows_per_chunk(vocab: int, chunk_rows: int | None) -> int:
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    return max(1, FP32_CHUNK_BYTES // (4 * max(vocab, 1)))


def _math_dtype(logits: Tensor) -> torch.dtype:
    # float32 at least: bf16/fp16 logits are upcast chunk by chunk; float64 stays float64.
    return torch.promote_types(logits.dtype, torch.float32)


def _upcast(chunk: Tensor) -> Tensor:
    return chunk.to(_math_dtype(chunk))


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature``; the sampling distribution at that temperature."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return logits if temperature == 1 else logits / temperature


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[label] per row, saving only the input logits and one float32 per row."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, rows: int) -> Tensor:
        logsumexp = torch.empty(logits.shape[0], dtype=_math_dtype(logits), device=logits.device)
        picked = torch.empty_like(logsumexp)
        for start in range(0, logits.shape[0], rows):
            chunk = _upcast(logits[start : start + rows])
            logsumexp[start : start + rows] = torch.logsumexp(chunk, dim=-1)
            picked[start : start + rows] = chunk.gather(-1, labels[start : start + rows, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.rows = rows
        return picked - logsumexp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, labels, logsumexp = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            g = _upcast(grad_out[start:end, None])
            # d logp[label] / d logits = onehot(label) - softmax(logits)
            chunk = (_upcast(logits[start:end]) - logsumexp[start:end, None]).exp_().mul_(-g)
            chunk.scatter_add_(-1, labels[start:end, None], g)
            grad[start:end] = chunk
        return grad, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits) per row, saving only the input logits and two float32 per row."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: int) -> Tensor:
        logsumexp = torch.empty(logits.shape[0], dtype=_math_dtype(logits), device=logits.device)
        entropy = torch.empty_like(logsumexp)
        for start in range(0, logits.shape[0], rows):
            chunk = _upcast(logits[start : start + rows])
            lse = torch.logsumexp(chunk, dim=-1)
            probs = (chunk - lse[:, None]).exp_()
            # H = logsumexp - E_p[logit]
            entropy[start : start + rows] = lse - (probs * chunk).sum(-1)
            logsumexp[start : start + rows] = lse
        ctx.save_for_backward(logits, logsumexp, entropy)
        ctx.rows = rows
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, logsumexp, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            chunk = _upcast(logits[start:end])
            log_probs = chunk - logsumexp[start:end, None]
            # dH/dlogit_j = -p_j * (log p_j + H)
            grad[start:end] = -log_probs.exp() * (log_probs + entropy[start:end, None]) * grad_out[start:end, None]
        return grad, None


def _check_rows(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V] gathered rows, got shape {list(logits.shape)}")


def compute_logprobs(logits: Tensor, labels: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """[N] float32 (float64 for float64 logits): log p(labels[n]) under softmax(logits[n]); differentiable."""
    _check_rows(logits)
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must have shape [{logits.shape[0]}], got {list(labels.shape)}")
    return _TokenLogprobs.apply(logits, labels.long(), _rows_per_chunk(logits.shape[-1], chunk_rows))


def compute_entropy(logits: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """[N] float32 (float64 for float64 logits): entropy of softmax(logits[n]); differentiable."""
    _check_rows(logits)
    return _Entropy.apply(logits, _rows_per_chunk(logits.shape[-1], chunk_rows))


# ---- the post registry ---------------------------------------------------------------------------------

LogitTransform = Callable[[Tensor], Tensor]

_TRANSFORMS: dict[str, tuple[type[BaseModel], Callable[[BaseModel], LogitTransform]]] = {}
# Computed by the engine from the transformed logits; naming one in ``post`` only asks for it.
_OUTPUTS = ("compute_logprobs", "compute_entropy")


def register_logit_transform(name: str, *, config_model: type[BaseModel]):
    """Decorator: ``build(config) -> transform`` makes ``{"name": name, "config": {...}}`` valid in ``post``."""

    def decorator(build: Callable[[BaseModel], LogitTransform]):
        if name in _TRANSFORMS or name in _OUTPUTS:
            raise ValueError(f"post-processor {name!r} is already registered")
        _TRANSFORMS[name] = (config_model, build)
        return build

    return decorator


def known_post_processors() -> list[str]:
    return sorted([*_TRANSFORMS, *_OUTPUTS])


class TemperatureConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(..., gt=0, allow_inf_nan=False, description="Divide the logits by this.")


@register_logit_transform("temperature", config_model=TemperatureConfig)
def _temperature(config: TemperatureConfig) -> LogitTransform:
    return partial(apply_temperature, temperature=config.temperature)


@dataclass(frozen=True)
class PostPipeline:
    """What ``processing["post"]`` asks of the engine: logit transforms in order, and whether to compute entropy."""

    transforms: tuple[LogitTransform, ...] = ()
    wants_entropy: bool = False

    def __call__(self, logits: Tensor) -> Tensor:
        for transform in self.transforms:
            logits = transform(logits)
        return logits


def _entry_parts(index: int, entry: object) -> tuple[object, Mapping]:
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, Mapping) and "name" in entry and set(entry) <= {"name", "config"}:
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise PostProcessingError(f"post[{index}].config must be a mapping, got {config!r}")
        return entry["name"], config
    raise PostProcessingError(f"post[{index}] must be a name or {{'name': ..., 'config': {{...}}}}, got {entry!r}")


def resolve_post(entries: Iterable[object] | None) -> PostPipeline:
    """Validate ``processing["post"]`` and build its pipeline; errors name the entry and the known names."""
    if entries is None:
        return PostPipeline()
    if isinstance(entries, (str, Mapping)) or not isinstance(entries, Iterable):
        raise PostProcessingError(f"post must be a list of post-processor entries, got {entries!r}")
    transforms: list[LogitTransform] = []
    wants_entropy = False
    for index, entry in enumerate(entries):
        name, config = _entry_parts(index, entry)
        if name in _OUTPUTS:
            if config:
                raise PostProcessingError(f"post[{index}]: {name!r} takes no config, got {dict(config)!r}")
            wants_entropy = wants_entropy or name == "compute_entropy"
            continue
        if not isinstance(name, str) or name not in _TRANSFORMS:
            raise PostProcessingError(
                f"post[{index}]: unknown post-processor {name!r}; known: {', '.join(known_post_processors())}"
            )
        config_model, build = _TRANSFORMS[name]
        try:
            transforms.append(build(config_model.model_validate(dict(config))))
        except ValidationError as err:
            raise PostProcessingError(f"post[{index}] {name!r}: {describe_validation_error(err)}") from None
    return PostPipeline(tuple(transforms), wants_entropy)
