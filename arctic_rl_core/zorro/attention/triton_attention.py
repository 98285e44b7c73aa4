"""The fused paged attention kernel (GPU): plain, prefill and Forest Cascade Attention from one work plan.

Two launches do all of it. ``_attend_items`` is a persistent kernel over the
plan's items (times KV heads): each program loads a tile of queries (a group's
members, or one request's heads), streams the item's KV positions through the
block table once, and keeps an online softmax. So a shared prefix is read once
per group, not once per request. Results go straight to the output when the
item is the query's only one, else to float32 partials with their
log-sum-exp. ``_merge_partials`` then combines each query's partials exactly.
Both take their sizes from device memory, so one CUDA graph serves every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from arctic_rl_core.zorro.attention.plan import ITEM_FIELDS, AttentionPlan, TileShape

LOG2E = 1.4426950408889634


@triton.jit
def _attend_items(
    Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE,
    BLOCK_TABLES, ITEMS, NUM_ITEMS, QUERY_INDEX, QUERY_POS,
    scale_log2,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_ot, stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    row_query = rows // GROUP
    row_head = rows % GROUP
    num_work = tl.load(NUM_ITEMS) * NUM_KV_HEADS
    for work in range(tl.program_id(0), num_work, NUM_PROGRAMS):
        item = ITEMS + (work // NUM_KV_HEADS) * 6
        kv_head = work % NUM_KV_HEADS
        query_offset = tl.load(item)
        query_count = tl.load(item + 1)
        table = BLOCK_TABLES + tl.load(item + 2).to(tl.int64) * stride_bt
        kv_start = tl.load(item + 3)
        kv_end = tl.load(item + 4)
        partial_row = tl.load(item + 5)

        row_valid = row_query < query_count
        token = tl.load(QUERY_INDEX + query_offset + row_query, mask=row_valid, other=0).to(tl.int64)
        position = tl.load(QUERY_POS + token, mask=row_valid, other=-1)
        head = kv_head * GROUP + row_head
        q = tl.load(
            Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )
        kv_stop = tl.minimum(kv_end, tl.max(position, axis=0) + 1)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for kv0 in range(kv_start, kv_stop, BLOCK_N):
            kv_pos = kv0 + cols
            kv_valid = kv_pos < kv_stop
            block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
            slot = block * BLOCK_SIZE + kv_pos % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            k = tl.load(K_CACHE + kv_offsets, mask=kv_valid[:, None], other=0.0)
            v = tl.load(V_CACHE + kv_offsets, mask=kv_valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            visible = kv_valid[None, :] & (kv_pos[None, :] <= position[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row that has seen no visible key keeps m = -inf; shift by 0 there to avoid inf - inf.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(scores - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if partial_row < 0:
            tl.store(
                OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                out.to(OUT.dtype.element_ty),
                mask=row_valid[:, None],
            )
        else:
            prow = (partial_row + row_query).to(tl.int64) * NUM_HEADS + head
            tl.store(PART_O + prow[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
            tl.store(PART_LSE + prow, lse, mask=row_valid)


@triton.jit
def _merge_partials(
    OUT, PART_O, PART_LSE, MERGE_OFFSETS, MERGE_ROWS,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    lo = tl.load(MERGE_OFFSETS + token)
    hi = tl.load(MERGE_OFFSETS + token + 1)
    if hi > lo:
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        head_valid = heads < NUM_HEADS
        m = tl.full([HEADS_PAD], float("-inf"), tl.float32)
        total = tl.zeros([HEADS_PAD], tl.float32)
        acc = tl.zeros([HEADS_PAD, HEAD_DIM], tl.float32)
        for e in range(lo, hi):
            prow = tl.load(MERGE_ROWS + e).to(tl.int64) * NUM_HEADS + heads
            lse = tl.load(PART_LSE + prow, mask=head_valid, other=float("-inf"))
            o = tl.load(PART_O + prow[:, None] * HEAD_DIM + dims[None, :], mask=head_valid[:, None], other=0.0)
            m_new = tl.maximum(m, lse)
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_shift)
            w = tl.exp(lse - m_shift)
            total = total * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o
            m = m_new
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(
            OUT + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(OUT.dtype.element_ty),
            mask=head_valid[:, None],
        )


@dataclass
class DevicePlan:
    """An ``AttentionPlan`` on the device, in buffers of fixed capacity (so a CUDA graph can replay it)."""

    wide_items: torch.Tensor  # [capacity, 6]
    narrow_items: torch.Tensor
    counts: torch.Tensor  # [2]: wide, narrow items in use
    query_index: torch.Tensor
    merge_offsets: torch.Tensor  # [num_queries + 1]
    merge_rows: torch.Tensor

    @classmethod
    def empty(cls, max_items: int, max_query_refs: int, max_queries: int, max_partial_rows: int, device) -> "DevicePlan":
        def buf(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(
            buf(max_items, ITEM_FIELDS), buf(max_items, ITEM_FIELDS), buf(2),
            buf(max_query_refs), buf(max_queries + 1), buf(max(max_partial_rows, 1)),
        )  # fmt: skip

    @classmethod
    def from_plan(cls, plan: AttentionPlan, device) -> "DevicePlan":
        def put(array):
            return torch.from_numpy(array).to(device, non_blocking=True)

        counts = torch.tensor([len(plan.wide_items), len(plan.narrow_items)], dtype=torch.int32)
        return cls(
            put(plan.wide_items), put(plan.narrow_items), counts.to(device),
            put(plan.query_index), put(plan.merge_offsets), put(plan.merge_rows),
        )  # fmt: skip


@dataclass
class Workspace:
    """Float32 partial outputs and log-sum-exps, reused by every layer."""

    partial_out: torch.Tensor  # [rows, num_heads, head_dim]
    partial_lse: torch.Tensor  # [rows, num_heads]

    @classmethod
    def allocate(cls, rows: int, num_heads: int, head_dim: int, device) -> "Workspace":
        rows = max(rows, 1)
        return cls(
            torch.empty(rows, num_heads, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, num_heads, dtype=torch.float32, device=device),
        )


def _num_programs(device: torch.device, per_sm: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    plan: DevicePlan,
    workspace: Workspace,
    scale: float,
    tiles: TileShape,
    wide: bool = True,
    narrow: bool = True,
    merge: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``plan`` over the paged cache; ``q``/``out`` are ``[tokens, num_heads, head_dim]``.

    ``wide`` / ``narrow`` / ``merge`` choose which launches to make; each is a
    no-op when its part of the plan is empty, so leaving one on is always
    correct and turning one off only saves its launch.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if k_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous in q, out and the caches")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(
        scale_log2=scale * LOG2E,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_bt=block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], PRECISION=precision,
    )  # fmt: skip
    args = (q, k_cache, v_cache, out, workspace.partial_out, workspace.partial_lse, block_tables)
    on_gpu = q.is_cuda
    if wide:
        programs = _num_programs(q.device, 1) if on_gpu else 4
        _attend_items[(programs,)](
            *args, plan.wide_items, plan.counts[0:], plan.query_index, query_positions,
            BLOCK_M=tiles.wide_rows, BLOCK_N=64, NUM_PROGRAMS=programs, num_warps=8, num_stages=2, **common,
        )  # fmt: skip
    if narrow:
        programs = _num_programs(q.device, 4) if on_gpu else 4
        _attend_items[(programs,)](
            *args, plan.narrow_items, plan.counts[1:], plan.query_index, query_positions,
            BLOCK_M=tiles.narrow_rows, BLOCK_N=64, NUM_PROGRAMS=programs, num_warps=4, num_stages=3, **common,
        )  # fmt: skip
    if merge:
        _merge_partials[(num_tokens,)](
            out, workspace.partial_out, workspace.partial_lse, plan.merge_offsets, plan.merge_rows,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, num_warps=4,
        )  # fmt: skip
    return out
