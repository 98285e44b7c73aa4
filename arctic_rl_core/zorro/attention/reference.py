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

import functools
from typing import Sequence

import torch

from arctic_rl_core.zorro.attention.forest import PrefixForest


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions ``[start, end)`` of one request, as ``[end - start, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    positions = torch.arange(start, end, device=cache.device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return cache.flatten(0, 1)[slots]


def gather_kv_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: Sequence[int],
    ends: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values at positions ``[starts[r], ends[r])`` of every request ``r``, padded to the longest, each
    ``[R, L, num_kv_heads, head_dim]``, and which entries are real, ``[R, L]``. Padding reads each request's
    first slot."""
    block_size, device = k_cache.shape[1], k_cache.device
    starts_t = torch.as_tensor(starts, dtype=torch.int64, device=device)
    ends_t = torch.as_tensor(ends, dtype=torch.int64, device=device)
    width = int((ends_t - starts_t).max()) if len(starts_t) else 0
    positions = starts_t[:, None] + torch.arange(width, device=device)[None, :]
    valid = positions < ends_t[:, None]
    positions = positions.where(valid, 0)
    blocks = block_tables[: len(starts_t)].long().gather(1, positions // block_size)
    slots = blocks * block_size + positions % block_size
    return k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots], valid


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


def batched_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request, ``q [R, H, D]``, over its own keys ``k, v [R, L, Hkv, D]`` where ``valid [R, L]``:
    ``attention_with_lse`` for every request in one pass (float32 output and log-sum-exp ``[R, H]``)."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[2]
    # Query head h reads KV head h // group, as repeat_interleave lays them out.
    q = q.float().view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rkgd,rlkd->rkgl", q, k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    out = torch.einsum("rkgl,rlkd->rkgd", weights, v.float())
    return out.reshape(rows, heads, dim), lse.reshape(rows, heads)


def merge_two_states(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``(out, lse)`` partials as one over the union of their key sets, with its log-sum-exp (outputs
    ``[..., H, D]``). A partial over no key (lse -inf, out 0) is the identity."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    total = torch.logaddexp(lse_a, lse_b)
    shift = total.clamp_min(torch.finfo(torch.float32).min)
    out = torch.exp(lse_a - shift)[..., None] * out_a + torch.exp(lse_b - shift)[..., None] * out_b
    return out, total


def merge_attention_states(states: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact softmax attention over the union of the key sets that produced ``(out, lse)`` partials."""
    return functools.reduce(merge_two_states, states)[0]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Plain attention of one query per request over its whole context: ``[B, H, D]`` in ``q``'s dtype.

    Each row is ``attention_with_lse`` of that query over ``gather_kv`` of its
    context; the requests run as one padded, masked batch.
    """
    k, v, valid = gather_kv_rows(k_cache, v_cache, block_tables, [0] * len(context_lens), context_lens)
    return batched_attention_with_lse(q, k, v, valid, scale)[0].to(q.dtype)


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
    """Forest Cascade Attention for one query per request; equals ``paged_decode_attention``.

    Each shared prefix is read once, for all its members; then every request's
    own suffix (one padded batch) is merged into what its prefixes gave.
    """
    if forest.num_requests != q.shape[0]:
        raise ValueError(f"forest covers {forest.num_requests} requests, q has {q.shape[0]}")
    state = (q.new_zeros(q.shape, dtype=torch.float32), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32))
    for prefix in forest.prefixes:
        k = gather_kv(k_cache, block_tables[prefix.source], prefix.start, prefix.end)
        v = gather_kv(v_cache, block_tables[prefix.source], prefix.start, prefix.end)
        members = torch.tensor(prefix.members, device=q.device)
        merged = merge_two_states((state[0][members], state[1][members]), attention_with_lse(q[members], k, v, scale))
        state[0][members], state[1][members] = merged
    k, v, valid = gather_kv_rows(k_cache, v_cache, block_tables, forest.suffix_starts, context_lens)
    return merge_two_states(state, batched_attention_with_lse(q, k, v, valid, scale))[0].to(q.dtype)
