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

Log-probs and entropy are computed in float32 math with a hand-written
backward pass: nothing float32 of size [N, V] is saved for backward.
(``log_softmax`` under autograd keeps its float32 [N, V] output alive until
backward, which for a 150k vocabulary is most of a GPU's memory at long
sequence lengths.) On CUDA, bf16/fp16/fp32 logits go through fused Triton
kernels (``softmax_kernels``) that read the logits once forward and once
backward and write the gradient in the logits' dtype; elsewhere, and for
float64, torch ops run over float32 (float64) chunks of rows, so no float32
copy of more than one chunk exists at a time. ``compute_logprobs_and_entropy``
shares one softmax between the two, forward and backward.
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


def _statistics_in_torch(
    logits: Tensor, labels: Tensor | None, want_entropy: bool, rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row (log-sum-exp, log p(label), entropy) in float32 (float64 for float64) chunks of ``rows`` rows."""
    logsumexp, picked, entropy = (
        torch.zeros(logits.shape[0], dtype=_math_dtype(logits), device=logits.device) for _ in range(3)
    )
    for start in range(0, logits.shape[0], rows):
        end = start + rows
        chunk = _upcast(logits[start:end])
        logsumexp[start:end] = torch.logsumexp(chunk, dim=-1)
        if labels is not None:
            picked[start:end] = chunk.gather(-1, labels[start:end, None]).squeeze(-1)
        if want_entropy:
            probs = (chunk - logsumexp[start:end, None]).exp_()
            # H = logsumexp - E_p[logit]; a -inf logit has p = 0 and adds 0, not 0 * -inf
            entropy[start:end] = logsumexp[start:end] - torch.linalg.vecdot(probs, torch.where(probs > 0, chunk, 0))
    return logsumexp, picked - logsumexp, entropy


def _gradient_in_torch(
    logits: Tensor,
    labels: Tensor | None,
    logsumexp: Tensor,
    entropy: Tensor,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    rows: int,
) -> Tensor:
    grad = torch.empty_like(logits)
    for start in range(0, logits.shape[0], rows):
        end = start + rows
        log_probs = _upcast(logits[start:end]) - logsumexp[start:end, None]
        probs = log_probs.exp()
        # d log p_label / d logit_j = [j = label] - p_j;  dH / d logit_j = -p_j * (log p_j + H)
        # so the total is -p_j * (g_logprob + g_entropy * (log p_j + H)) + g_logprob * [j = label]
        coefficient = log_probs  # the buffer is reused: log_probs is not needed after this
        if grad_entropy is None:
            coefficient.zero_()
        else:
            coefficient.add_(entropy[start:end, None]).mul_(grad_entropy[start:end, None])
        if grad_logprobs is not None:
            coefficient.add_(grad_logprobs[start:end, None])
        chunk_grad = coefficient.mul_(probs).neg_()
        if grad_entropy is not None:
            chunk_grad.masked_fill_(probs == 0, 0)  # p_j = 0 (a -inf logit) contributes 0, not 0 * -inf
        if grad_logprobs is not None:
            chunk_grad.scatter_add_(-1, labels[start:end, None], grad_logprobs[start:end, None])
        grad[start:end] = chunk_grad
    return grad


def _fused(logits: Tensor) -> bool:
    """The Triton kernels serve CUDA bf16/fp16/fp32; float64 and the CPU keep the exact torch path."""
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)


class _SoftmaxStatistics(torch.autograd.Function):
    """Per row of ``logits``: log p(label) and/or the entropy, in float32 math, with a hand-written backward.

    Only the input logits and two numbers per row are saved for backward; the
    softmax is recomputed there. Asked for both, the log-prob and entropy
    gradients are formed from a single recomputed softmax. ``fused`` runs the
    Triton kernels (one read of the logits forward, one read and one write of
    the gradient backward); else float32 torch ops run over chunks of ``rows``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor | None, want_entropy: bool, rows: int, fused: bool):
        ctx.set_materialize_grads(False)
        if fused:
            from arctic_rl_core.processors.softmax_kernels import softmax_statistics

            logits = logits if logits.stride(-1) == 1 else logits.contiguous()
            logsumexp, logprobs, entropy = softmax_statistics(logits, labels, want_entropy)
        else:
            logsumexp, logprobs, entropy = _statistics_in_torch(logits, labels, want_entropy, rows)
        ctx.save_for_backward(logits, labels, logsumexp, entropy)
        ctx.rows, ctx.fused = rows, fused
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        logits, labels, logsumexp, entropy = ctx.saved_tensors
        if ctx.fused:
            from arctic_rl_core.processors.softmax_kernels import softmax_statistics_backward

            grad = softmax_statistics_backward(logits, labels, logsumexp, entropy, grad_logprobs, grad_entropy)
        else:
            grad = _gradient_in_torch(logits, labels, logsumexp, entropy, grad_logprobs, grad_entropy, ctx.rows)
        return grad, None, None, None, None


def _check_rows(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V] gathered rows, got shape {list(logits.shape)}")


def _check_labels(logits: Tensor, labels: Tensor) -> Tensor:
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must have shape [{logits.shape[0]}], got {list(labels.shape)}")
    return labels.long()


def _statistics(logits: Tensor, labels: Tensor | None, want_entropy: bool, chunk_rows: int | None):
    rows = _rows_per_chunk(logits.shape[-1], chunk_rows)
    return _SoftmaxStatistics.apply(logits, labels, want_entropy, rows, _fused(logits))


def compute_logprobs(logits: Tensor, labels: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """[N] float32 (float64 for float64 logits): log p(labels[n]) under softmax(logits[n]); differentiable."""
    _check_rows(logits)
    labels = _check_labels(logits, labels)
    logprobs, _ = _statistics(logits, labels, False, chunk_rows)
    return logprobs


def compute_entropy(logits: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """[N] float32 (float64 for float64 logits): entropy of softmax(logits[n]); differentiable."""
    _check_rows(logits)
    _, entropy = _statistics(logits, None, True, chunk_rows)
    return entropy


def compute_logprobs_and_entropy(
    logits: Tensor, labels: Tensor, *, chunk_rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """Both of the above from one pass over ``logits`` forward and one backward: use it when a loss needs both."""
    _check_rows(logits)
    labels = _check_labels(logits, labels)
    return _statistics(logits, labels, True, chunk_rows)


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
