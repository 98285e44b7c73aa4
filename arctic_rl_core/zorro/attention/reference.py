"""Paged attention in plain torch: the numbers every kernel is tested against, and the CPU path.

KV caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``; a request's
block table maps its position ``t`` to slot ``table[t // block_size] *
block_size + t % block_size``. Queries are ``[tokens, num_heads, head_dim]``
with ``num_heads`` a multiple of ``num_kv_heads`` (grouped-query attention).

``cascade_attention`` is Forest Cascade Attention: one pass of a group's
queries over each shared prefix (its keys and values read once for the whole
group), one pass per request over its own suffix, and an exact merge of the
partial results by their log-sum-exp weights.
"""

from __future__ import annotations

from typing import Sequence

import torch

from arctic_rl_core.zorro.attention.forest import PrefixForest


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions ``[start, end)`` of one request, as ``[end - start, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    positions = torch.arange(start, end, device=cache.device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return cache.flatten(0, 1)[slots]


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None = None,
    key_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [M, H, D]`` over ``k, v [N, Hkv, D]``: float32 output and log-sum-exp ``[M, H]``.

    With ``query_positions``, key ``j`` (at position ``key_start + j``) is visible
    to query ``i`` only if it is not after ``query_positions[i]`` (causal).
    A query that sees no key gets output 0 and log-sum-exp -inf, the identity of
    the merge.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if query_positions is not None:
        key_positions = torch.arange(key_start, key_start + k.shape[0], device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None].to(key_positions.device)
        scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    out = torch.einsum("hmn,nhd->mhd", weights, v)
    return out, lse.transpose(0, 1).contiguous()


def merge_attention_states(states: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact softmax attention over the union of the key sets that produced ``(out, lse)`` partials."""
    outs = torch.stack([o for o, _ in states])
    lses = torch.stack([lse for _, lse in states])
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.clamp_min(torch.finfo(torch.float32).min)[None])
    return (weights[..., None] * outs).sum(dim=0)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Plain attention of one query per request over its whole context: ``[B, H, D]`` in ``q``'s dtype."""
    out = torch.empty_like(q)
    for r, length in enumerate(context_lens):
        k = gather_kv(k_cache, block_tables[r], 0, length)
        v = gather_kv(v_cache, block_tables[r], 0, length)
        out[r] = attention_with_lse(q[r : r + 1], k, v, scale)[0][0].to(q.dtype)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new tokens (its last ``query_lens[r]`` positions) over its context.

    ``q`` holds the requests' new tokens back to back; their keys and values are
    already in the cache, after any cached prefix.
    """
    out = torch.empty_like(q)
    offset = 0
    for r, (n_new, length) in enumerate(zip(query_lens, context_lens)):
        k = gather_kv(k_cache, block_tables[r], 0, length)
        v = gather_kv(v_cache, block_tables[r], 0, length)
        positions = torch.arange(length - n_new, length, device=q.device)
        rows = slice(offset, offset + n_new)
        out[rows] = attention_with_lse(q[rows], k, v, scale, query_positions=positions)[0].to(q.dtype)
        offset += n_new
    return out


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    forest: PrefixForest,
    scale: float,
) -> torch.Tensor:
    """Forest Cascade Attention for one query per request; equals ``paged_decode_attention``."""
    if forest.num_requests != q.shape[0]:
        raise ValueError(f"forest covers {forest.num_requests} requests, q has {q.shape[0]}")
    states: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(q.shape[0])]
    for prefix in forest.prefixes:
        k = gather_kv(k_cache, block_tables[prefix.source], prefix.start, prefix.end)
        v = gather_kv(v_cache, block_tables[prefix.source], prefix.start, prefix.end)
        members = list(prefix.members)
        out, lse = attention_with_lse(q[members], k, v, scale)
        for i, r in enumerate(members):
            states[r].append((out[i], lse[i]))
    for r, (start, length) in enumerate(zip(forest.suffix_starts, context_lens)):
        if start < length:
            k = gather_kv(k_cache, block_tables[r], start, length)
            v = gather_kv(v_cache, block_tables[r], start, length)
            out, lse = attention_with_lse(q[r : r + 1], k, v, scale)
            states[r].append((out[0], lse[0]))
    return torch.stack([merge_attention_states(s) for s in states]).to(q.dtype)
