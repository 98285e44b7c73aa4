"""Attention over the paged KV cache for one forward step: the GPU kernel's plan, or the torch reference on CPU.

The model runner builds one ``AttentionMetadata`` per step; every layer reads
it. On CUDA it carries a work plan for the fused Triton kernel (plain,
prefill or Forest Cascade, the kernel does not care which). On CPU it carries
the per-request lengths and, for decode batches that share prefixes, the
prefix forest that the cascade reference consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arctic_rl_core.zorro.attention import reference
from arctic_rl_core.zorro.attention.forest import PrefixForest
from arctic_rl_core.zorro.attention.plan import TileShape


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [tokens]: cache slot of each new token; -1 for graph padding
    positions: torch.Tensor  # [tokens]: each query's position (its causal limit)
    block_tables: torch.Tensor  # [requests, max_blocks] int32
    context_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    forest: PrefixForest | None = None
    # The GPU kernel's inputs: a DevicePlan, a Workspace, whether the plan has wide (group) tiles and partials.
    plan: object | None = None
    workspace: object | None = None
    tiles: TileShape | None = None
    wide: bool = True
    merge: bool = True


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention output ``[tokens, num_heads, head_dim]`` for queries whose new keys are already in the cache."""
    if meta.plan is not None:
        from arctic_rl_core.zorro.attention import triton_attention

        return triton_attention.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.positions, meta.plan, meta.workspace, scale, meta.tiles,
            wide=meta.wide, merge=meta.merge,
        )  # fmt: skip
    if meta.is_prefill:
        return reference.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_lens, meta.context_lens, scale
        )
    if meta.forest is not None and meta.forest.has_sharing:
        return reference.cascade_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.forest, scale
        )
    return reference.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
