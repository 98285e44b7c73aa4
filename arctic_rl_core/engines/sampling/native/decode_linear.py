"""Linear layers of decode batches (CUDA): a few rows times a weight matrix, the weights read once at memory speed.

A decode step multiplies a handful of token rows by every weight matrix, so
its projections are reads of the weights, and their speed is how many bytes
are in flight. cuBLAS tiles these shapes by the weight's output dimension
only: a 1152×896 projection runs as 18 programs, a few percent of an H200's
multiprocessors, and takes 4.5 µs for 2 MB (``benchmarks/decode_profile.py``).
Here each program reads a ``block_n × K/split_k`` slice of the weight: the
grid is sized to fill the device, splitting K where the output dimension alone
is too narrow. The last program to finish an output tile sums the tile's
K-slices in a fixed order, so results do not depend on timing.

``gated=True`` computes a fused gate/up projection's ``silu(gate) * up``
directly (gate rows ``[0, n)``, up rows ``[n, 2n)`` of the weight), so the
intermediate activation never goes to memory at twice its size.

The work between a layer's projections happens in their epilogues, so a
layer is four projection launches around its attention. An RMS norm is
linear in each row up to one scale: the projection before it adds into the
residual stream and hands on ``stream * norm weight`` with each row's sum of
squares (``into_residual``); the projection after it scales each output row
by ``1 / rms`` (``row_norm``). ``rotary`` rotates each query and key head of
a q/k/v projection as it finishes it and writes keys and values to the cache.
On an H100 this took a Qwen2-0.5B decode step at G=16 over an 8K prompt
from 1.13 to 1.01 ms (``benchmarks/fca.py``, FCA on), and the B=64 step's
graph from 1.21 to 1.10 ms (``benchmarks/sampling.py``), each against the
unfused code in the same call.

Most of the gain comes from ``pdl=True`` (Hopper on): launched as a
programmatic dependent of the kernel before it, a program asks L2 for its
first weights while that kernel finishes, and waits for it only before
reading its input. A Qwen2-0.5B layer's four projections at 16 rows take
19.7 µs that way, 22.3 µs launched plainly and 25.9 µs with cuBLAS
(``benchmarks/decode_linear.py --chain-only``, H200).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from arctic_rl_core.engines.sampling.native.ops import RotaryStore
from arctic_rl_core.engines.sampling.native.triton_ops import rotary_inputs, rotary_store_tile

MAX_ROWS = 64  # decode batches up to this many rows take this path; larger ones are matmuls cuBLAS tiles well
# Past 16 rows cuBLAS reads large weights faster (Qwen2.5-7B's projections, 26-271 MB, at 64 rows: 0.66-0.93x
# of its speed on an H200); the small ones still gain from launching as programmatic dependents.
TALL_BATCH_MAX_WEIGHT_BYTES = 20 << 20
# Weight bytes one launch may prefetch into L2 while the kernel before it runs: a third of an H200's L2, so
# the prefetch does not evict what the running kernel still reads (a 7B layer's projections are 100-270 MB).
PREFETCH_BYTES = 16 << 20
MAX_STAGES = 6  # the K loop's software pipeline, at most (pick_tiles)


@dataclass(frozen=True)
class LinearTiles:
    """A program reads ``block_n`` weight rows over ``K / split_k`` columns, ``block_k`` columns per step."""

    block_n: int
    block_k: int
    split_k: int
    warps: int = 4
    stages: int = 4

    def launch(self, n: int, k: int) -> tuple[int, int, int]:
        """For an ``n × k`` weight: output tiles, K-slices (``split_k`` or fewer: none is empty) and each slice's
        columns, a multiple of ``block_k``. The launch is ``output tiles × K-slices`` programs."""
        k_per_split = triton.cdiv(k // self.block_k, self.split_k) * self.block_k
        return triton.cdiv(n, self.block_n), triton.cdiv(k, k_per_split), k_per_split


def pick_tiles(
    rows: int, n: int, k: int, num_sms: int, gated: bool = False, block_n: int | None = None,
    max_stages: int = MAX_STAGES,
) -> LinearTiles | None:  # fmt: skip
    """Tiles for an ``n × k`` weight at ``rows`` rows, or None where cuBLAS is the better choice.

    From ``benchmarks/decode_linear.py --sweep`` on an H200: 64-row weight
    tiles, K split only while the grid is short of one wave and each split
    keeps at least four 128-column steps (a long K, as in the down
    projection). Batches of 17-64 rows keep cuBLAS for weights over 20 MB.
    ``block_n`` asks for tiles of that many output columns (one head, for
    ``rotary``); ``max_stages`` caps the pipeline below (``decode_linear.py
    --chain-stages`` times other caps).

    The K loop's software pipeline is as deep as a slice's steps use (one
    more stage than steps puts them all in flight), up to six stages and
    what fits in shared memory. After its wait a projection's weights come
    from L2 (prefetched) and its input was just written, so its time there is
    rounds of L2 latency: at 16 rows, six stages instead of four took
    Qwen2-0.5B's four projections from 23.2 to 21.0-21.3 µs per layer, and
    the G=16 decode step over an 8K prompt from 0.947 to 0.891 ms, FCA on
    (``decode_linear.py --chain-stages``, ``fca.py --linear-tiles``, H100,
    one call); eight stages took 21.5 µs, and at 64 rows every depth 28.3.
    """
    if rows > MAX_ROWS or k % 64 or n % (block_n or 16):
        return None
    if rows > 16 and (2 if gated else 1) * n * k * 2 > TALL_BATCH_MAX_WEIGHT_BYTES:
        return None
    block_k = 128 if k % 128 == 0 else 64
    block_n = block_n or (64 if n % 64 == 0 else 16)
    tiles_n = triton.cdiv(n, block_n)
    steps = k // block_k
    split_k = 1
    while tiles_n * split_k < num_sms and steps // (2 * split_k) >= 4:
        split_k *= 2
    slice_steps = triton.cdiv(steps, split_k)
    fits = (200 << 10) // stage_bytes(rows, block_n, block_k, gated)
    return LinearTiles(block_n, block_k, split_k, stages=max(1, min(max_stages, slice_steps + 1, fits)))


def stage_bytes(rows: int, block_n: int, block_k: int, gated: bool = False) -> int:
    """Shared memory one stage of the K loop's software pipeline takes: a step's weight tile (two, ``gated``) and
    its input rows, in 16-bit values."""
    return ((2 if gated else 1) * block_n + max(16, triton.next_power_of_2(rows))) * block_k * 2


@triton.jit
def _rows_times_slice(X, W, row, col, up_col, k_lo, k_hi, stride_x, stride_w, acc, up,
                      GATED: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``acc += W[col, k] @ X[row, k]^T`` over ``k`` in ``[k_lo, k_hi)``: acc is ``[block_n, block_m]``; with
    ``GATED`` also ``up += W[up_col, k] @ X[row, k]^T`` in the same steps.

    One loop for both halves: each step's loads are in flight together, and
    Triton's software pipeline (``num_stages``) fills once instead of twice.
    """
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(X + row[:, None] * stride_x + (k0 + ks)[None, :])
        w = tl.load(W + col[:, None] * stride_w + (k0 + ks)[None, :])
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(W + up_col[:, None] * stride_w + (k0 + ks)[None, :])
            up = tl.dot(w_up, tl.trans(x), up, input_precision=PRECISION)
    return acc, up


@triton.jit
def _prefetch_to_l2(W, col, k_lo, k_hi, stride_w, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for ``W[col, k_lo:k_hi]``, one request per 128-byte line (64 bf16), without waiting for it."""
    for k0 in range(k_lo, k_hi, 64 * LINES):
        ks = tl.minimum(k0 + tl.arange(0, LINES) * 64, k_hi - 1)
        address = (W + col[:, None] * stride_w + ks[None, :]).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [address], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _decode_linear_kernel(
    X, W, BIAS, Y, PARTIAL, COUNTERS, SUM_SQUARES, RESIDUAL, NORM_WEIGHT, SUM_SQUARES_OUT,
    POS, COS, SIN, Q_NORM, K_NORM, K_CACHE, V_CACHE, SLOTS,
    rows, n, k_per_split, K, prefetch_k, stride_x, stride_w, stride_y, stride_r, parts, eps,
    stride_cos, stride_qh, stride_ks, stride_kh, qk_eps,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    SCALE_ROWS: tl.constexpr, PARTS: tl.constexpr, INTO_RESIDUAL: tl.constexpr,
    ROTARY: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_N, rows]`` output tile over one K-slice; with ``SPLIT_K > 1`` the tile's last slice finishes it.

    Rows past ``rows`` read row 0 (in bounds, never stored); weight rows past
    ``n`` read row 0 of the weight likewise. ``SCALE_ROWS`` and
    ``INTO_RESIDUAL`` are the two halves of an RMS norm between projections
    (``decode_linear``'s ``row_norm`` and ``into_residual``); ``ROTARY``
    finishes a q/k/v projection as ``ops.rotary_and_store`` would (``rotary``).
    """
    tile = tl.program_id(0)
    split = tl.program_id(1)
    col = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, BLOCK_M)
    col_ok = col < n
    row_ok = row < rows
    w_col = tl.where(col_ok, col, 0).to(tl.int64)
    x_row = tl.where(row_ok, row, 0)
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    in_bounds = row_ok[None, :] & col_ok[:, None]
    # The epilogue's other inputs are asked for before the K loop, so that they arrive while it runs instead
    # of adding their latency after it. Weights, positions and slots come before the wait: no kernel of the
    # step writes them (the engine copies positions and slots in before the step). Only the loads move: an
    # operation on a loaded value before the loop (a reduction, a layout change) would wait for the load
    # there, and hold back the loop's first loads with it.
    if HAS_BIAS:
        bias = tl.load(BIAS + w_col).to(tl.float32)
    if INTO_RESIDUAL:
        norm_weight = tl.load(NORM_WEIGHT + w_col).to(tl.float32)
    if ROTARY:
        cos, sin, slot = rotary_inputs(x_row, POS, COS, SIN, SLOTS, stride_cos, BLOCK_N)
    if USE_PDL:
        # Launched while the kernel before runs (programmatic dependent launch): the weights do not depend
        # on it, so start the first ``prefetch_k`` columns of ours towards L2, then wait for its output (x).
        k_ahead = tl.minimum(k_hi, k_lo + prefetch_k)
        _prefetch_to_l2(W, w_col, k_lo, k_ahead, stride_w, BLOCK_N, 8)
        if GATED:
            _prefetch_to_l2(W, w_col + n, k_lo, k_ahead, stride_w, BLOCK_N, 8)
        gdc_wait()
        gdc_launch_dependents()
    if SCALE_ROWS:
        # x was ``stream * norm weight``: each output row takes its 1 / rms, from the stream's sums of squares
        # that the projection before left in ``parts`` column tiles (summed after the loop).
        part_ids = tl.arange(0, PARTS)
        squares = tl.load(SUM_SQUARES + part_ids[:, None] * BLOCK_M + row[None, :],
                          mask=(part_ids < parts)[:, None], other=0.0)  # fmt: skip
    # (Without GATED, ``up`` stays zeros and is never read.)
    acc, up = _rows_times_slice(X, W, x_row, w_col, w_col + n, k_lo, k_hi, stride_x, stride_w,
                                tl.zeros([BLOCK_N, BLOCK_M], tl.float32), tl.zeros([BLOCK_N, BLOCK_M], tl.float32),
                                GATED, BLOCK_K, PRECISION)  # fmt: skip

    finish = True
    if SPLIT_K > 1:
        # Park this slice's sums; the tile's last slice to arrive adds all of them, in slice order.
        tile_offsets = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + row[None, :]
        base = PARTIAL + (tile * SPLIT_K + split).to(tl.int64) * (2 * BLOCK_N * BLOCK_M)
        tl.store(base + tile_offsets, acc)
        if GATED:
            tl.store(base + BLOCK_N * BLOCK_M + tile_offsets, up)
        tl.debug_barrier()  # every thread's sums are written before the release below publishes them
        arrived = tl.atomic_add(COUNTERS + tile, 1, sem="acq_rel", scope="gpu")
        finish = arrived == SPLIT_K - 1
        if finish:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(SPLIT_K):
                part = PARTIAL + (tile * SPLIT_K + s).to(tl.int64) * (2 * BLOCK_N * BLOCK_M)
                acc += tl.load(part + tile_offsets, cache_modifier=".cg")
                if GATED:
                    up += tl.load(part + BLOCK_N * BLOCK_M + tile_offsets, cache_modifier=".cg")
            tl.store(COUNTERS + tile, 0)  # ready for the next launch, which reads them only once we are done

    if finish:
        dtype = Y.dtype.element_ty
        if INTO_RESIDUAL:
            # Read here, not before the loop: Triton changes its layout where it is loaded, and that wait
            # before the loop took the o projection from 3.2-3.5 to 4.6-4.8 us (decode_linear.py --chain-parts,
            # H100, one call).
            res = RESIDUAL + row[None, :] * stride_r + col[:, None]
            residual = tl.load(res, mask=in_bounds, other=0.0).to(tl.float32)
        if SCALE_ROWS:
            inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
            acc *= inv_rms[None, :]
            if GATED:
                up *= inv_rms[None, :]
        if HAS_BIAS:
            acc += bias[:, None]
        # Round where the unfused layers round: the projection's output, then the activation.
        out = acc.to(dtype)
        if GATED:
            gate = out.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * up.to(dtype).to(tl.float32)).to(dtype)
        if INTO_RESIDUAL:
            # The residual stream takes our output (in place; this tile's columns are ours alone), and the
            # next projection gets ``stream * norm weight`` with this tile's share of each row's sum of squares.
            stream = (out.to(tl.float32) + residual).to(dtype)
            tl.store(res, stream, mask=in_bounds)
            streamf = tl.where(in_bounds, stream.to(tl.float32), 0.0)
            tl.store(SUM_SQUARES_OUT + tile * BLOCK_M + row, tl.sum(streamf * streamf, axis=0))
            out = (streamf * norm_weight[:, None]).to(dtype)
        if ROTARY:
            rotary_store_tile(out, tile, x_row, row_ok, cos, sin, slot, Q_NORM, K_NORM, Y, K_CACHE, V_CACHE,
                              stride_y, stride_qh, stride_ks, stride_kh, qk_eps, NUM_HEADS, NUM_KV_HEADS, BLOCK_N,
                              QK_NORM, BLOCK_M)  # fmt: skip
        else:
            tl.store(Y + row[None, :] * stride_y + col[:, None], out, mask=in_bounds)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_NUM_SMS: dict[torch.device, int] = {}
COUNTER_CAPACITY = 1 << 14  # output tiles of one split-K launch, at most


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Arrival counters, one per output tile, zero between launches (each launch leaves them zero).

    One set per device and thread: an engine launches its steps from one thread, one after another,
    so its split-K launches never run at once; an engine on another thread has its own set. CUDA
    graphs keep the address of the set they were captured with, so a set is never replaced.
    """
    if tiles > COUNTER_CAPACITY:
        raise ValueError(f"decode_linear: {tiles} output tiles in one split-K launch; at most {COUNTER_CAPACITY}")
    key = (device, threading.get_ident())
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTER_CAPACITY, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def num_sms(device: torch.device) -> int:
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    tiles: LinearTiles | None = None,
    pdl: bool = False,
    *,
    row_norm: tuple[torch.Tensor, float] | None = None,
    into_residual: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotary: RotaryStore | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T + bias`` (or, ``gated``, ``silu(gate) * up`` of it) for ``x`` of at most ``MAX_ROWS`` rows.

    ``tiles`` defaults to ``pick_tiles`` for the shape; a shape it declines raises. ``pdl`` launches the
    kernel as a programmatic dependent of the one before (Hopper on): it prefetches its weights while
    that kernel finishes.

    An RMS norm between two projections needs no launch of its own:

    - ``into_residual=(residual, norm_weight)`` adds the output into ``residual`` (in place) and returns
      ``(residual * norm_weight, sum_squares)``: the sums of squares of ``residual``'s rows, one float32
      row ``[block_m]`` per output tile.
    - ``row_norm=(sum_squares, eps)`` takes that pair's first half as ``x`` and scales each output row by
      ``1 / rms`` before the bias and the activation: together, the projection of ``rms_norm(residual)``.

    ``rotary`` finishes a q/k/v projection as ``ops.rotary_and_store`` would, with no launch of its own: it
    returns the rotated queries ``[rows, num_heads, head_dim]`` and writes keys and values to their cache
    slots. Its tiles are one head wide. With ``pdl`` its positions and slots are read before the wait for
    the kernel before, so no kernel of the same dependent chain may write them (the engine copies them in).
    """
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if tiles is None:
        head_tiles = rotary.k_cache.shape[-1] if rotary is not None else None
        tiles = pick_tiles(rows, n, k, num_sms(x.device) if x.is_cuda else 132, gated, block_n=head_tiles)
        if tiles is None:
            raise ValueError(f"decode_linear has no tiles for {rows} rows of a {n}x{k} weight; use F.linear")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("decode_linear needs x and weight contiguous along K")
    block_m = max(16, triton.next_power_of_2(rows))
    tiles_n, split_k, k_per_split = tiles.launch(n, k)
    if rotary is None:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        rotary_args = dict.fromkeys(("POS", "COS", "SIN", "Q_NORM", "K_NORM", "K_CACHE", "V_CACHE", "SLOTS"), y)
        rotary_args |= dict(stride_cos=0, stride_ks=0, stride_kh=0, qk_eps=0.0)
    else:
        y, rotary_args = _rotary_arguments(rotary, rows, n, tiles, gated or into_residual is not None, x)
    weight_rows = tiles_n * split_k * tiles.block_n * (2 if gated else 1)
    prefetch_k = min(k_per_split, PREFETCH_BYTES // (weight_rows * weight.element_size()) // 64 * 64)
    if split_k > 1:
        partial = torch.empty(tiles_n * split_k * 2 * tiles.block_n * block_m, dtype=torch.float32, device=x.device)
        counters = _counters(x.device, tiles_n)
    else:
        partial = counters = y
    sum_squares, eps = row_norm if row_norm is not None else (y, 0.0)
    parts = sum_squares.shape[0] if row_norm is not None else 1
    if row_norm is not None and sum_squares.shape[1] != block_m:
        raise ValueError(
            f"row_norm: sum_squares has rows of {sum_squares.shape[1]}; expected {block_m} for {rows} rows"
        )
    residual, norm_weight = into_residual if into_residual is not None else (y, y)
    if into_residual is not None and gated:
        raise ValueError("into_residual needs a plain projection; gated=True has two outputs per column")
    if into_residual is not None and (residual.shape != y.shape or norm_weight.shape != (n,)):
        raise ValueError(f"into_residual: expected a residual of {tuple(y.shape)} and a norm weight of ({n},); "
                         f"got {tuple(residual.shape)} and {tuple(norm_weight.shape)}")  # fmt: skip
    sum_squares_out = y
    if into_residual is not None:
        sum_squares_out = torch.empty(tiles_n, block_m, dtype=torch.float32, device=x.device)
    _decode_linear_kernel[(tiles_n, split_k)](
        X=x, W=weight, BIAS=bias if bias is not None else weight, Y=y, PARTIAL=partial, COUNTERS=counters,
        SUM_SQUARES=sum_squares, RESIDUAL=residual, NORM_WEIGHT=norm_weight, SUM_SQUARES_OUT=sum_squares_out,
        rows=rows, n=n, k_per_split=k_per_split, K=k, prefetch_k=prefetch_k, stride_x=x.stride(0),
        stride_w=weight.stride(0), stride_y=y.stride(0), stride_r=residual.stride(0), parts=parts, eps=eps,
        stride_qh=y.stride(1), **rotary_args,
        HAS_BIAS=bias is not None, GATED=gated, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        SCALE_ROWS=row_norm is not None, PARTS=triton.next_power_of_2(parts),
        INTO_RESIDUAL=into_residual is not None, ROTARY=rotary is not None,
        NUM_HEADS=rotary.num_heads if rotary else 0, NUM_KV_HEADS=rotary.num_kv_heads if rotary else 0,
        QK_NORM=rotary is not None and rotary.q_norm is not None,
        num_warps=tiles.warps, num_stages=tiles.stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return (y, sum_squares_out) if into_residual is not None else y


def _rotary_arguments(rotary: RotaryStore, rows: int, n: int, tiles: LinearTiles, other_epilogue: bool, x):
    """The queries' output ``[rows, num_heads, head_dim]`` and the kernel's rotary arguments, by name."""
    if other_epilogue:
        raise ValueError("rotary finishes a plain q/k/v projection; it does not combine with gated or into_residual")
    heads, kv_heads, head_dim = rotary.num_heads, rotary.num_kv_heads, rotary.k_cache.shape[-1]
    if n != (heads + 2 * kv_heads) * head_dim or tiles.block_n != head_dim:
        raise ValueError(f"rotary: expected a plain q/k/v projection of {(heads + 2 * kv_heads) * head_dim} outputs "
                         f"in tiles of one head ({head_dim}); got {n} outputs in tiles of {tiles.block_n}")  # fmt: skip
    q = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)
    cache = rotary.k_cache
    return q, dict(
        POS=rotary.positions, COS=rotary.cos, SIN=rotary.sin,
        Q_NORM=rotary.q_norm if rotary.q_norm is not None else q,
        K_NORM=rotary.k_norm if rotary.k_norm is not None else q,
        K_CACHE=cache, V_CACHE=rotary.v_cache, SLOTS=rotary.slots,
        stride_cos=rotary.cos.stride(0), stride_ks=cache.stride(1), stride_kh=cache.stride(2), qk_eps=rotary.eps,
    )  # fmt: skip
