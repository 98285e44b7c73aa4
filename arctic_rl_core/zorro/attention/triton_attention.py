"""The fused paged attention kernel (GPU): plain, prefill and Forest Cascade Attention from one work plan.

Two launches do all of it. ``_attend_items`` is a persistent kernel over the
plan's items (times KV heads): each program loads a tile of queries (a group's
members, or one request's heads), streams the item's KV positions through the
block table once, and keeps an online softmax. So a shared prefix is read once
per group, not once per request. Results go straight to the output when the
item is the query's only one, else to partials (in the attention dtype) with
their float32 log-sum-exp. ``_merge_partials`` then combines each query's
partials exactly. Both take their sizes from device memory, so one CUDA graph
serves every step. The attention kernel runs as many programs as fit on the
device at once (from its compiled registers). On Hopper both are launched as
programmatic dependents: the attention kernel's start overlaps the tail of the
kernel that wrote its queries, and the merge's the attention kernel's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from arctic_rl_core import triton_aot
from arctic_rl_core.zorro.attention.plan import ITEM_FIELDS, KV_ALIGN, AttentionPlan, TileShape

LOG2E = 1.4426950408889634
# Items start at multiples of the block size or of KV_ALIGN, whichever is smaller (plan.py).
_ITEM_ALIGN = tl.constexpr(KV_ALIGN)

_PDL: dict[torch.device, bool] = {}
# The merge's programs are many and small: at 2 warps (not 4) its launch after the attention kernel took 1.5 us
# less at 4 groups x 16 on an H100 (24.6 -> 23.1 us for both launches; 1 warp: 23.5).
MERGE_WARPS = 2

# Shared memory and L1 are one array per multiprocessor, split per kernel (its carveout), and programs of kernels
# with different splits do not share a multiprocessor. Triton asks for the largest shared part for kernels that use
# over 48 KiB (the attention kernel with pipelined wide tiles) and leaves the others' to the driver, so the merge's
# programs, launched early as dependents, could not start beside the attention kernel's last ones: on an H100 the
# merge added 1.5-1.8 us after the attention launch at 1x16 instead of 0.6-0.8 (27th session, same call). Both
# kernels ask for the same split here.
SHARED_CARVEOUT: int | None = 100  # percent of the array as shared memory; None: Triton's and the driver's choice
_CARVEOUT_KERNELS = frozenset({"_attend_items", "_merge_partials"})
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
log = logging.getLogger(__name__)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _ask_carveout(module, function, name, metadata_group, hash) -> None:
    """Triton's kernel-load hook: the attention and merge kernels ask for ``SHARED_CARVEOUT`` (see above)."""
    if name in _CARVEOUT_KERNELS and SHARED_CARVEOUT is not None:
        status = _libcuda().cuFuncSetAttribute(
            ctypes.c_void_p(function), _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, SHARED_CARVEOUT
        )
        if status:  # only a preference: the kernel runs either way
            log.warning("cuFuncSetAttribute(%s, preferred shared memory carveout) returned CUDA error %d", name, status)


knobs.runtime.kernel_load_end_hook.add(_ask_carveout)


def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched as programmatic dependents (griddepcontrol, Hopper on)."""
    if device not in _PDL:
        _PDL[device] = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return _PDL[device]


@triton.jit
def _block_ids(table, kv0, kv_end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache block of each position ``kv0 + i`` (0 from the first block wholly past ``kv_end``)."""
    if BLOCK_N % BLOCK_SIZE == 0 and _ITEM_ALIGN % BLOCK_SIZE == 0:
        # Every item starts at a multiple of the block size (plan.py), and so does every step: position
        # kv0 + i is in block kv0 // BLOCK_SIZE + i // BLOCK_SIZE, with no per-position division.
        index = kv0 // BLOCK_SIZE + tl.arange(0, BLOCK_N) // BLOCK_SIZE
        return tl.load(table + index, mask=index * BLOCK_SIZE < kv_end, other=0)
    else:
        kv_pos = kv0 + tl.arange(0, BLOCK_N)
        return tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_pos < kv_end, other=0)


@triton.jit
def _load_kv(
    K_CACHE, V_CACHE, blocks, kv0, kv_end, kv_head, stride_kb, stride_ks, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, INT32_OFFSETS: tl.constexpr,
):  # fmt: skip
    """Keys and values at positions ``kv0 + [0, BLOCK_N)`` of one KV head, zero from ``kv_end`` on.

    Their offsets are in 64 bits, or with ``INT32_OFFSETS`` (the launch
    checked that the whole cache is within 2**31 values of its start) in 32:
    each of a thread's rows then costs one multiply-add, and each address one
    shift-add from the cache's start instead of a 64-bit multiply, shift and
    add.
    """
    kv_pos = kv0 + tl.arange(0, BLOCK_N)
    if BLOCK_N % BLOCK_SIZE == 0 and _ITEM_ALIGN % BLOCK_SIZE == 0:
        # As in _block_ids: each row's offset in its block is a constant, with no per-position division.
        in_block = (tl.arange(0, BLOCK_N) % BLOCK_SIZE) * stride_ks
    else:
        in_block = (kv_pos % BLOCK_SIZE) * stride_ks
    if INT32_OFFSETS:
        # Unsigned (the values are never negative): a signed offset costs a sign extension per address.
        row = (blocks * stride_kb + in_block).to(tl.uint32)
        column = (kv_head * stride_kh + tl.arange(0, HEAD_DIM)).to(tl.uint32)
    else:
        row = blocks.to(tl.int64) * stride_kb + in_block
        column = kv_head * stride_kh + tl.arange(0, HEAD_DIM)
    offsets = row[:, None] + column[None, :]
    valid = (kv_pos < kv_end)[:, None]
    return tl.load(K_CACHE + offsets, mask=valid, other=0.0), tl.load(V_CACHE + offsets, mask=valid, other=0.0)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _halve_twice(x, combine):
    """``x`` [M, N] combined down to [M, N // 4] columns, so that a row reduction after it is a tree.

    ``tl.max``/``tl.sum`` combine a thread's elements of a row in one serial
    chain (16 dependent instructions per row of a 64-key step on Hopper);
    after this it is 4 deep. The pairs (adjacent columns, then columns half a
    row apart) sit in one thread in the MMA layout, so no data moves.
    """
    m: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [m, n // 2, 2]))
    x = combine(even, odd)
    low, high = tl.split(tl.permute(tl.reshape(x, [m, 2, n // 4]), [0, 2, 1]))
    return combine(low, high)


@triton.jit
def _softmax_step(
    scores, v, acc, l_i, m_i, kv0, kv_end, position, scale_log2,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, masked,
):  # fmt: skip
    """One step of the online softmax over keys ``kv0 + [0, BLOCK_N)``, from their unscaled ``scores``.

    The running max is kept scaled (``scale_log2 > 0``), so the scale meets each
    score once, in the exponent's multiply-add.
    """
    if masked:  # keys past the range or past a query's own position
        kv_pos = kv0 + tl.arange(0, BLOCK_N)
        scores = tl.where((kv_pos[None, :] < kv_end) & (kv_pos[None, :] <= position[:, None]), scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(_halve_twice(scores, _maximum), axis=1) * scale_log2)
    # A row that has seen no visible key keeps m = -inf; shift by 0 there to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores * scale_log2 - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(_halve_twice(p, _add), axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_item(
    Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE, BLOCK_TABLES, item, kv_head, QUERY_INDEX, QUERY_POS,
    scale_log2, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr, first,
    WAIT: tl.constexpr, MAY_OVERRUN: tl.constexpr, INT32_OFFSETS: tl.constexpr,
):  # fmt: skip
    """One work unit: a tile of queries (``BLOCK_M // GROUP`` of them, all heads of one KV head) over a KV range.

    Triton pipelines the step loop (``LOOP_STAGES``) so that each step's
    memory latency hides behind the steps before. A step's keys and values
    wait for its block ids, so they go ahead two stages per step: from 5
    stages on the keys and values of two steps are in flight in shared
    memory (the wide tiles' default; ``TileShape.wide_stages``).

    A program's ``first`` unit (with early loads) waits here for the kernel
    before it (programmatic dependent launch, ``WAIT``), after the loads that
    kernel cannot be writing: the plan, the block table and the query
    positions. So the chain of dependent loads that starts the unit overlaps
    its tail.
    """
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_query = rows // GROUP
    query_offset = tl.load(item)
    query_count = tl.load(item + 1)
    table = BLOCK_TABLES + tl.load(item + 2).to(tl.int64) * stride_bt
    kv_start = tl.load(item + 3)
    kv_end = tl.load(item + 4)
    partial_row = tl.load(item + 5)
    row_valid = row_query < query_count
    token = tl.load(QUERY_INDEX + query_offset + row_query, mask=row_valid, other=0).to(tl.int64)
    position = tl.load(QUERY_POS + token, mask=row_valid, other=-1)
    queries_end = tl.max(tl.where(row_valid, position, -1), axis=0) + 1
    if MAY_OVERRUN:
        # A decode suffix's last item may end past its query (the plan keeps room for later steps), where
        # the cache holds anything: cut the range there before any key is loaded.
        kv_end = tl.minimum(kv_end, queries_end)
    if WAIT:
        if first:
            gdc_wait()

    head = kv_head * GROUP + rows % GROUP
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=row_valid[:, None],
                other=0.0)  # fmt: skip
    if not MAY_OVERRUN:
        # Multi-query items end at or before their last query, so this cut is kept off the first load's path
        # (which would otherwise wait for the query index and positions, two more dependent loads).
        kv_end = tl.minimum(kv_end, queries_end)
    # Steps wholly before every query's position and the range end need no mask (all of decode but the last).
    # (A second loop for the masked steps, c3aa66a, freed ~40 registers in the wide tiles but measured slower:
    # 27.5 vs 24.7 us at 4x16 on an H100, same call.)
    unmasked_end = tl.minimum(kv_end, tl.min(tl.where(row_valid, position, kv_end), axis=0) + 1)
    full_end = kv_start + tl.maximum(unmasked_end - kv_start, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for kv0 in tl.range(kv_start, kv_end, BLOCK_N, num_stages=LOOP_STAGES):
        k, v = _load_kv(K_CACHE, V_CACHE, _block_ids(table, kv0, kv_end, BLOCK_SIZE, BLOCK_N), kv0, kv_end,
                        kv_head, stride_kb, stride_ks, stride_kh, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                        INT32_OFFSETS)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        acc, l_i, m_i = _softmax_step(scores, v, acc, l_i, m_i, kv0, kv_end, position, scale_log2, BLOCK_N,
                                      PRECISION, masked=kv0 >= full_end)  # fmt: skip

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if partial_row < 0:
        tl.store(OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_valid[:, None])  # fmt: skip
    else:
        prow = (partial_row + row_query).to(tl.int64) * NUM_HEADS + head
        tl.store(PART_O + prow[:, None] * HEAD_DIM + dims[None, :], out.to(PART_O.dtype.element_ty),
                 mask=row_valid[:, None])  # fmt: skip
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(PART_LSE + prow, lse, mask=row_valid)


@triton.jit
def _attend_items(
    Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE, BLOCK_TABLES, WIDE_ITEMS, NARROW_ITEMS, COUNTS, QUERY_INDEX,
    QUERY_POS, scale_log2, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WIDE_M: tl.constexpr, NARROW_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WIDE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    NARROW_STAGES: tl.constexpr, WIDE_STAGES: tl.constexpr, INT32_OFFSETS: tl.constexpr,
):  # fmt: skip
    """Persistent over (item, KV head) work units: the wide items first (the longest), then the narrow ones.

    One launch for both widths lets the short suffix units fill the device
    while the grouped prefix units run, instead of waiting for them. With
    ``EARLY`` each program waits for the kernel before it inside its first
    unit, after that unit's early loads; else before anything.
    """
    if USE_PDL and not EARLY:
        # Launched as a programmatic dependent: the queries and the cache are the kernels' before us.
        gdc_wait()
    # Plans run with HAS_WIDE=False have no wide items, so the first branch is never taken there.
    num_wide = tl.load(COUNTS) * NUM_KV_HEADS
    num_work = num_wide + tl.load(COUNTS + 1) * NUM_KV_HEADS
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        if EARLY:
            first = work == tl.program_id(0)
        else:
            first = work < 0  # never true: a runtime false of the same type, as the program already waited
        if work < num_wide:
            if HAS_WIDE:
                _attend_item(
                    Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE, BLOCK_TABLES,
                    WIDE_ITEMS + (work // NUM_KV_HEADS) * 6, work % NUM_KV_HEADS, QUERY_INDEX, QUERY_POS,
                    scale_log2, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
                    NUM_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, WIDE_M, BLOCK_N, PRECISION, LOOP_STAGES=WIDE_STAGES,
                    first=first, WAIT=USE_PDL, MAY_OVERRUN=False, INT32_OFFSETS=INT32_OFFSETS,
                )  # fmt: skip
        else:
            unit = work - num_wide
            _attend_item(
                Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE, BLOCK_TABLES,
                NARROW_ITEMS + (unit // NUM_KV_HEADS) * 6, unit % NUM_KV_HEADS, QUERY_INDEX, QUERY_POS,
                scale_log2, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
                NUM_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, NARROW_M, BLOCK_N, PRECISION, LOOP_STAGES=NARROW_STAGES,
                first=first, WAIT=USE_PDL, MAY_OVERRUN=True, INT32_OFFSETS=INT32_OFFSETS,
            )  # fmt: skip
    if USE_PDL:
        if EARLY:
            # A program with no unit waits too: the kernels after us count on everything before us being done.
            gdc_wait()
        # This program is done: the merge's programs may take its place and read their indices early.
        gdc_launch_dependents()


@triton.jit
def _merge_partials(
    OUT, PART_O, PART_LSE, MERGE_OFFSETS, MERGE_ROWS, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One (query, head): softmax-weighted sum of its partials, ``BLOCK_E`` partials per vectorised step.

    With ``USE_PDL`` it starts while the attention kernel's last programs run
    and waits for that kernel's writes only before reading partials.
    """
    token = tl.program_id(0)
    head = tl.program_id(1)
    lo = tl.load(MERGE_OFFSETS + token)
    hi = tl.load(MERGE_OFFSETS + token + 1)
    dims = tl.arange(0, HEAD_DIM)
    # The plan's indices are read ahead of each step (before the wait, for the first).
    entries = lo + tl.arange(0, BLOCK_E)
    prow = tl.load(MERGE_ROWS + entries, mask=entries < hi, other=0).to(tl.int64) * NUM_HEADS + head
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for e0 in range(lo, hi, BLOCK_E):
        valid = e0 + tl.arange(0, BLOCK_E) < hi
        lse = tl.load(PART_LSE + prow, mask=valid, other=float("-inf"))
        o = tl.load(PART_O + prow[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
        entries = e0 + BLOCK_E + tl.arange(0, BLOCK_E)
        prow = tl.load(MERGE_ROWS + entries, mask=entries < hi, other=0).to(tl.int64) * NUM_HEADS + head
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse - m_shift)
        alpha = tl.exp(m - m_shift)
        total = total * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o.to(tl.float32), axis=0)
        m = m_new
    if hi > lo:
        out = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(OUT + token * stride_ot + head * stride_oh + dims, out.to(OUT.dtype.element_ty))


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
    def empty(
        cls, max_items: int, max_query_refs: int, max_queries: int, max_partial_rows: int, device
    ) -> "DevicePlan":
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
    """Partial outputs (in the attention dtype) and their float32 log-sum-exps, reused by every layer."""

    partial_out: torch.Tensor  # [rows, num_heads, head_dim]
    partial_lse: torch.Tensor  # [rows, num_heads]

    @classmethod
    def allocate(cls, rows: int, num_heads: int, head_dim: int, device, dtype=torch.float32) -> "Workspace":
        rows = max(rows, 1)
        return cls(
            torch.empty(rows, num_heads, head_dim, dtype=dtype, device=device),
            torch.empty(rows, num_heads, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class Build:
    """One build of the attention kernel on a device: how many of its programs fit at once, and per thread
    its registers and spilled bytes (``benchmarks/fca_sweep.py`` prints them)."""

    programs: int
    registers: int
    spills: int


BUILDS: dict[tuple, Build] = {}
HOPPER_REGS_PER_SM = 65536
HOPPER_SHARED_PER_SM = 233472


def programs_per_sm(
    registers: int, warps: int, shared: int, regs_per_sm: int = HOPPER_REGS_PER_SM,
    shared_per_sm: int = HOPPER_SHARED_PER_SM,
) -> int:  # fmt: skip
    """How many programs of a kernel fit on one multiprocessor at once (Hopper's limits by default)."""
    # Registers are granted per warp in units of 256; a multiprocessor holds at most 64 warps.
    per_sm = min(regs_per_sm // (-(-registers * 32 // 256) * 256 * warps), 64 // warps)
    if shared:
        per_sm = min(per_sm, shared_per_sm // (shared + 1024))  # 1 KiB per block is reserved
    return max(per_sm, 1)


def _resident_programs(args, options: dict, device) -> int:
    """As many persistent programs as fit on the device at once, from the compiled kernel's registers and memory.

    More would wait for a free slot and then run their share of the work
    after everyone else's; fewer would leave multiprocessors idle.
    """
    key = (device, tuple(sorted(options.items())))
    if key not in BUILDS:
        compiled = _attend_items.warmup(*args, grid=(1,), **options)
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        per_sm = programs_per_sm(
            compiled.n_regs, options["num_warps"], compiled.metadata.shared,
            getattr(props, "regs_per_multiprocessor", HOPPER_REGS_PER_SM),
            getattr(props, "shared_memory_per_multiprocessor", HOPPER_SHARED_PER_SM),
        )  # fmt: skip
        BUILDS[key] = Build(props.multi_processor_count * per_sm, compiled.n_regs, compiled.n_spills)
    return BUILDS[key].programs


def kernel_options(
    tiles: TileShape, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    wide: bool, use_pdl: bool, cache_fits_int32: bool = True,
) -> dict:  # fmt: skip
    """``_attend_items``'s compile-time constants and launch options for one model's attention.

    ``cache_fits_int32``: every value of the caches is within 2**31 values of
    their start (``fits_int32_offsets``), so ``tiles.int32_offsets`` may apply.
    """
    options = dict(
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=tiles.group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, WIDE_M=tiles.wide_rows, NARROW_M=tiles.narrow_rows, BLOCK_N=tiles.block_n,
        HAS_WIDE=wide, PRECISION="ieee" if dtype == torch.float32 else "tf32", USE_PDL=use_pdl,
        EARLY=tiles.early_loads, NARROW_STAGES=tiles.stages, WIDE_STAGES=tiles.wide_stages,
        INT32_OFFSETS=tiles.int32_offsets and cache_fits_int32,
        num_warps=tiles.wide_warps if wide else 4, num_stages=tiles.stages,
    )  # fmt: skip
    if wide and tiles.wide_maxnreg:
        options["maxnreg"] = tiles.wide_maxnreg
    return options


def fits_int32_offsets(cache: torch.Tensor) -> bool:
    """Whether every value of ``cache`` lies within 2**31 values of its first, so 32-bit offsets reach them all."""
    last = sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))
    return cache.numel() == 0 or last < 2**31


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_attention(
    tiles: TileShape, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    wide: bool, target=triton_aot.HOPPER,
):  # fmt: skip
    """``_attend_items`` built ahead of time for ``target`` (no GPU needed), as ``paged_attention`` launches it there."""
    options = kernel_options(tiles, num_heads, num_kv_heads, head_dim, block_size, dtype, wide, use_pdl=True)
    launch = {name: options.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in options}
    value = "*" + _DTYPE_NAMES[dtype]
    types = dict.fromkeys(("Q", "K_CACHE", "V_CACHE", "OUT", "PART_O"), value)
    plan = ("BLOCK_TABLES", "WIDE_ITEMS", "NARROW_ITEMS", "COUNTS", "QUERY_INDEX", "QUERY_POS")
    types.update(dict.fromkeys(plan, "*i32"), PART_LSE="*fp32", scale_log2="fp32")
    # Whole allocations, and the strides of [tokens, heads, dim] and [blocks, slots, kv heads, dim] with dim % 16 == 0;
    # the block table's row stride (its width) varies.
    strides = ("stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_ot", "stride_oh")
    aligned = [name for name in (*types, *strides) if name != "scale_log2"]
    return triton_aot.compile_for(_attend_items, types, options, aligned, target, **launch)


def _launch_options(
    num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: TileShape, dtype: torch.dtype, wide: bool,
) -> dict:  # fmt: skip
    """``kernel_options`` for a launch of ``paged_attention`` over these caches."""
    fits = tiles.int32_offsets and fits_int32_offsets(k_cache) and fits_int32_offsets(v_cache)
    use_pdl = tiles.pdl and supports_pdl(k_cache.device)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return kernel_options(tiles, num_heads, num_kv_heads, head_dim, block_size, dtype, wide, use_pdl, fits)


def plan_lanes(
    num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: TileShape, dtype: torch.dtype,
    wide: bool = True,
) -> int | None:  # fmt: skip
    """``plan_decode``'s ``lanes`` for launches over these caches: the kernel's programs per KV head.

    None until ``paged_attention`` has built that kernel on the caches' device
    (the count comes from its compiled registers).
    """
    options = _launch_options(num_heads, k_cache, v_cache, tiles, dtype, wide)
    build = BUILDS.get((k_cache.device, tuple(sorted(options.items()))))
    return None if build is None else max(build.programs // k_cache.shape[2], 1)


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
    merge: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``plan`` over the paged cache; ``q``/``out`` are ``[tokens, num_heads, head_dim]``.

    ``wide=False`` compiles the kernel without the wide-tile path (plans with
    no group items: plain decode), ``merge=False`` skips the merge launch
    (plans whose items all write directly: prefill).
    """
    num_tokens, num_heads, head_dim = q.shape
    if not scale > 0:
        raise ValueError(f"paged_attention's scale must be positive (the kernel keeps its maxima scaled), got {scale}")
    if head_dim < 16 or head_dim & (head_dim - 1):  # tiles span the head dimension; matrix products need K >= 16
        raise ValueError(f"paged_attention needs a head dimension that is a power of two of at least 16, got "
                         f"{head_dim}")  # fmt: skip
    if out is None:
        out = torch.empty_like(q)
    if k_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous in q, out and the caches")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"paged_attention needs one layout for both caches, got strides {k_cache.stride()} (keys) "
                         f"and {v_cache.stride()} (values)")  # fmt: skip
    options = _launch_options(num_heads, k_cache, v_cache, tiles, q.dtype, wide)
    use_pdl = options["USE_PDL"]
    args = (
        q, k_cache, v_cache, out, workspace.partial_out, workspace.partial_lse, block_tables, plan.wide_items,
        plan.narrow_items, plan.counts, plan.query_index, query_positions, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], out.stride(0), out.stride(1), block_tables.stride(0),
    )  # fmt: skip
    programs = _resident_programs(args, options, q.device) if q.is_cuda else 4
    _attend_items[(programs,)](*args, **options, **({"launch_pdl": True} if use_pdl else {}))
    if merge:
        _merge_partials[(num_tokens, num_heads)](
            out, workspace.partial_out, workspace.partial_lse, plan.merge_offsets, plan.merge_rows,
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_E=64, USE_PDL=use_pdl,
            num_warps=MERGE_WARPS, **({"launch_pdl": True} if use_pdl else {}),
        )  # fmt: skip
    return out
