"""Tensor-parallel resharding of Hugging Face Llama/Qwen/Mistral weights, by parameter name.

An inference replica with tensor parallelism ``tp`` holds, on rank ``p``, the
slice of each weight that its layer type owns (the Megatron/vLLM layouts):

- column-parallel (output rows split): ``q_proj``, ``gate_proj``, ``up_proj``
  and their biases; ``k_proj``/``v_proj`` split by key-value head, and when a
  model has fewer kv heads than ``tp`` each rank keeps the one kv head its
  query heads attend to (rank p gets head ``p * num_kv_heads // tp``);
- row-parallel (input columns split): ``o_proj``, ``down_proj``; their biases
  are added once after the reduction, so every rank keeps them whole;
- vocab-parallel (vocabulary rows split): ``embed_tokens``, ``lm_head``;
- replicated: every norm (``input_layernorm``, ``q_norm``, ``model.norm``, ...).

Every shard is a ``narrow`` of the full tensor: one (dim, start, length) per
(name, rank), computed here once and used by senders (to slice) and
receivers (to know the shapes they will get).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from arctic_rl_core.models.forward import head_dim as config_head_dim


@dataclass(frozen=True)
class AttentionHeads:
    """The head geometry resharding needs (kv heads cannot be told apart from shapes alone)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config: Any) -> "AttentionHeads":
        num_heads = config.num_attention_heads
        return cls(num_heads, getattr(config, "num_key_value_heads", None) or num_heads, config_head_dim(config))


@dataclass(frozen=True)
class Narrow:
    """Rank p's shard is ``full.narrow(dim, start, length)``."""

    dim: int
    start: int
    length: int


_COLUMN = re.compile(r"\.mlp\.(gate_proj|up_proj)\.(weight|bias)$")
_QUERY = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_KEY_VALUE = re.compile(r"\.self_attn\.(k_proj|v_proj)\.(weight|bias)$")
_OUTPUT = re.compile(r"\.self_attn\.o_proj\.weight$")
_DOWN = re.compile(r"\.mlp\.down_proj\.weight$")
_ROW_BIAS = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.bias$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_NORM = re.compile(r"norm\.(weight|bias)$")


def _even(name: str, size: int, dim: int, tp: int, rank: int, what: str) -> Narrow:
    if size % tp:
        raise ValueError(f"cannot shard {name} over tp={tp}: its {what} ({size}, dim {dim}) is not divisible by {tp}")
    length = size // tp
    return Narrow(dim, rank * length, length)


def _check_heads(name: str, size: int, dim: int, count: int, heads: AttentionHeads, what: str) -> None:
    if size != count * heads.head_dim:
        raise ValueError(
            f"{name} has size {size} on dim {dim}, expected {what}={count} x head_dim={heads.head_dim}; "
            "are the AttentionHeads those of this model?"
        )


def _by_heads(
    name: str, size: int, dim: int, count: int, heads: AttentionHeads, tp: int, rank: int, what: str
) -> Narrow:
    """Whole heads per rank: an even split of the rows alone could cut a head in two."""
    _check_heads(name, size, dim, count, heads, what)
    if count % tp:
        raise ValueError(f"cannot shard {name} over tp={tp}: {what}={count} is not divisible by {tp}")
    length = count // tp * heads.head_dim
    return Narrow(dim, rank * length, length)


def tp_narrow(
    name: str, shape: Sequence[int], tp_rank: int, tp_size: int, heads: AttentionHeads | None
) -> Narrow | None:
    """How rank ``tp_rank`` of ``tp_size`` slices parameter ``name``; None when it keeps the whole tensor."""
    if tp_size == 1 or _NORM.search(name) or _ROW_BIAS.search(name):
        return None
    if _VOCAB.search(name):
        return _even(name, shape[0], 0, tp_size, tp_rank, "vocabulary")
    if _COLUMN.search(name):
        return _even(name, shape[0], 0, tp_size, tp_rank, "output size")
    if _DOWN.search(name):
        return _even(name, shape[1], 1, tp_size, tp_rank, "input size")
    attention = _QUERY.search(name) or _OUTPUT.search(name) or _KEY_VALUE.search(name)
    if attention and heads is None:
        raise ValueError(f"resharding {name} over tp={tp_size} needs the model's AttentionHeads")
    if _QUERY.search(name):
        return _by_heads(name, shape[0], 0, heads.num_heads, heads, tp_size, tp_rank, "num_heads")
    if _OUTPUT.search(name):
        return _by_heads(name, shape[1], 1, heads.num_heads, heads, tp_size, tp_rank, "num_heads")
    if _KEY_VALUE.search(name):
        if heads.num_kv_heads >= tp_size:
            return _by_heads(name, shape[0], 0, heads.num_kv_heads, heads, tp_size, tp_rank, "num_kv_heads")
        _check_heads(name, shape[0], 0, heads.num_kv_heads, heads, "num_kv_heads")
        if tp_size % heads.num_kv_heads:
            raise ValueError(
                f"cannot replicate {name}: tp={tp_size} is not a multiple of num_kv_heads={heads.num_kv_heads}"
            )
        head = tp_rank * heads.num_kv_heads // tp_size
        return Narrow(0, head * heads.head_dim, heads.head_dim)
    raise ValueError(
        f"no tensor-parallel rule for {name!r} (tp={tp_size}); resharding knows the Llama/Qwen/Mistral layouts"
    )


def tp_shard_shape(
    name: str, shape: Sequence[int], tp_rank: int, tp_size: int, heads: AttentionHeads | None
) -> tuple[int, ...]:
    narrow = tp_narrow(name, shape, tp_rank, tp_size, heads)
    shape = tuple(int(d) for d in shape)
    if narrow is None:
        return shape
    return shape[: narrow.dim] + (narrow.length,) + shape[narrow.dim + 1 :]


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int, heads: AttentionHeads | None) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``full``, as a view."""
    narrow = tp_narrow(name, full.shape, tp_rank, tp_size, heads)
    return full if narrow is None else full.narrow(narrow.dim, narrow.start, narrow.length)
