"""Triton kernels of the model's fused operations (CUDA); ``ops`` holds their torch twins and dispatches here.

The layer kernels are launched as programmatic dependents of the kernel
before them where the device has it (``supports_pdl``): each waits for its
predecessor's writes before reading anything, so a launch's start-up overlaps
its predecessor's tail instead of following it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from arctic_rl_core.engines.sampling.native import ops
from arctic_rl_core.zorro.attention.triton_attention import supports_pdl

# The noise hash's strides, as ops.row_keys and ops.gumbel_noise use them.
_STEP_STRIDE = tl.constexpr(ops.STEP_STRIDE)
_TOKEN_STRIDE = tl.constexpr(ops.TOKEN_STRIDE)


def _launch_options(device: torch.device) -> dict:
    return {"USE_PDL": True, "launch_pdl": True} if supports_pdl(device) else {"USE_PDL": False}


@triton.jit
def _wait_for_predecessor(USE_PDL: tl.constexpr):
    """Under programmatic dependent launch: wait for the kernel before (its writes are our inputs), then let
    the kernel after start its own launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    _wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * y).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x)
    # The residual stream is ours (the previous layer's output), so it is updated in place.
    residual_out = residual if residual is not None else torch.empty_like(x)
    res_in = residual if residual is not None else x
    n_cols = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, res_in, weight, out, residual_out, x.stride(0), res_in.stride(0), out.stride(0), residual_out.stride(0),
        n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols), num_warps=4,
        **_launch_options(x.device),
    )  # fmt: skip
    return out, residual_out


@triton.jit
def _scale_rows_kernel(
    X, SUM_SQUARES, OUT, stride_x, stride_o, n_cols, parts, eps,
    BLOCK: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One row of a deferred norm (``ops.DeferredNorm``): ``x / rms``, the rms from its sums of squares in parts."""
    _wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.arange(0, PARTS)
    squares = tl.load(SUM_SQUARES + part * BLOCK_M + row, mask=part < parts, other=0.0)
    inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (x * inv_rms).to(OUT.dtype.element_ty), mask=mask)


def scale_rows(x: torch.Tensor, sum_squares: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    parts, block_m = sum_squares.shape
    _scale_rows_kernel[(x.shape[0],)](
        x, sum_squares, out, x.stride(0), out.stride(0), x.shape[1], parts, eps,
        BLOCK=triton.next_power_of_2(x.shape[1]), PARTS=triton.next_power_of_2(parts), BLOCK_M=block_m, num_warps=4,
        **_launch_options(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _norm_rope_columns(x1, x2, W, cos, sin, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """A head's optional RMS norm over its dims (Qwen3), then the half-split rotary embedding, for a tile of
    tokens: ``x1``, ``x2`` are the halves ``[HALF, tokens]``, ``cos``/``sin`` theirs."""
    if HAS_NORM:
        dtype = W.dtype.element_ty
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)[None, :]
        half = tl.arange(0, HALF)
        w1 = tl.load(W + half).to(tl.float32)[:, None]
        w2 = tl.load(W + HALF + half).to(tl.float32)[:, None]
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def rotary_inputs(token, POS, COS, SIN, SLOTS, stride_cos, HEAD_DIM: tl.constexpr):
    """What ``rotary_store_tile`` reads besides the projection's output: cos and sin ``[HEAD_DIM / 2, tokens]``
    at each token's position, and each token's cache slot ``[1, tokens]``.

    None of it is the projection's, so a projection can ask for it before its K loop. Every head reads all
    of it (a few hundred bytes, in bounds for any head): query heads ignore the slots, value heads the angles.
    """
    half = tl.arange(0, HEAD_DIM // 2)[:, None]
    pos = tl.load(POS + token).to(tl.int64)[None, :]
    cos = tl.load(COS + pos * stride_cos + half)
    sin = tl.load(SIN + pos * stride_cos + half)
    slot = tl.load(SLOTS + token).to(tl.int64)[None, :]
    return cos, sin, slot


@triton.jit
def rotary_store_tile(
    out, head, token, token_ok, cos, sin, slot, Q_NORM, K_NORM, Q_OUT, K_CACHE, V_CACHE,
    stride_qt, stride_qh, stride_ks, stride_kh, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """One head's q/k/v projection output ``[HEAD_DIM, tokens]``: a query head rotated into ``Q_OUT``, a key
    head rotated and a value head as is into their cache slots (none for a negative slot).

    ``head`` counts query heads, then key heads, then value heads. ``token`` must be in range (``token_ok``
    says which to write); ``cos``, ``sin`` and ``slot`` are ``rotary_inputs``' for the same tokens.
    The q/k/v projection's epilogue calls it on each finished head (``decode_linear``), ``rotary_and_store``
    on each head of a projection's output in memory.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    x1, x2 = tl.split(tl.permute(tl.reshape(out.to(tl.float32), [2, HALF, BLOCK_M]), [1, 2, 0]))
    half = tl.arange(0, HALF)[:, None]
    dtype = Q_OUT.dtype.element_ty
    if head < NUM_HEADS + NUM_KV_HEADS:
        if head < NUM_HEADS:
            x1, x2 = _norm_rope_columns(x1, x2, Q_NORM, cos, sin, eps, QK_NORM, HALF)
        else:
            x1, x2 = _norm_rope_columns(x1, x2, K_NORM, cos, sin, eps, QK_NORM, HALF)
    if head < NUM_HEADS:
        dst = Q_OUT + token[None, :].to(tl.int64) * stride_qt + head * stride_qh + half
        tl.store(dst, x1.to(dtype), mask=token_ok[None, :])
        tl.store(dst + HALF, x2.to(dtype), mask=token_ok[None, :])
    else:
        write = token_ok[None, :] & (slot >= 0)
        if head < NUM_HEADS + NUM_KV_HEADS:
            dst = K_CACHE + slot * stride_ks + (head - NUM_HEADS) * stride_kh + half
        else:
            dst = V_CACHE + slot * stride_ks + (head - NUM_HEADS - NUM_KV_HEADS) * stride_kh + half
        tl.store(dst, x1.to(dtype), mask=write)
        tl.store(dst + HALF, x2.to(dtype), mask=write)


@triton.jit
def _rotary_store_kernel(
    QKV, POS, COS, SIN, Q_NORM, K_NORM, Q_OUT, K_CACHE, V_CACHE, SLOTS, tokens,
    stride_qkv, stride_qt, stride_qh, stride_cos, stride_ks, stride_kh, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One head of ``BLOCK_M`` tokens of the q/k/v projection's output: ``rotary_store_tile``."""
    _wait_for_predecessor(USE_PDL)
    token = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    token_ok = token < tokens
    token = tl.where(token_ok, token, 0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    cos, sin, slot = rotary_inputs(token, POS, COS, SIN, SLOTS, stride_cos, HEAD_DIM)
    tile = tl.load(QKV + token[None, :].to(tl.int64) * stride_qkv + head * HEAD_DIM + dims[:, None])
    rotary_store_tile(tile, head, token, token_ok, cos, sin, slot, Q_NORM, K_NORM, Q_OUT, K_CACHE, V_CACHE,
                      stride_qt, stride_qh, stride_ks, stride_kh, eps, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM,
                      BLOCK_M)  # fmt: skip


ROTARY_TOKENS = 16  # tokens per program of ``rotary_and_store``


def rotary_and_store(qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, num_heads, num_kv_heads):
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _rotary_store_kernel[(triton.cdiv(tokens, ROTARY_TOKENS), num_heads + 2 * num_kv_heads)](
        qkv, positions, cos, sin, q_norm if has_norm else qkv, k_norm if has_norm else qkv, q, k_cache, v_cache, slots,
        tokens, qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm,
        BLOCK_M=ROTARY_TOKENS, num_warps=2, **_launch_options(qkv.device),
    )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(GATE_UP, OUT, stride_g, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GATE_UP + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_g + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n_cols = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n_cols, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _mix32(h):
    """``ops.mix32`` in native uint32 arithmetic."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x31848BAB
    return h ^ (h >> 16)


@triton.jit
def _inverse_temperature(temperature):
    """1 / temperature, and 1 for greedy rows (temperature 0), whose logits are not scaled."""
    greedy = temperature == 0.0
    return tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))


@triton.jit(do_not_specialize=["step"])  # a new value every call: one compiled kernel for all
def _sample_split_kernel(
    LOGITS, TEMPERATURE, MIN_LOGIT, NOISE_KEYS, FIRST_STEPS, BANNED, MIN_TOKENS,
    PART_MAX, PART_SUM, PART_BEST, PART_INDEX, step, stride_l, stride_b, vocab, num_splits,
    NUM_BANNED: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr,
):  # fmt: skip
    """One slice of one row's vocabulary: the max and exp-sum of what the log-prob scores (the raw logits, or
    with ``PROCESSED`` the allowed tokens' scaled logits) and its best Gumbel score."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(TEMPERATURE + row)
    inv_t = _inverse_temperature(temperature)
    noise_scale = tl.where(temperature == 0.0, 0.0, 1.0)
    floor = tl.load(MIN_LOGIT + row)
    token_number = tl.load(FIRST_STEPS + row) + step
    # ops.row_keys, in int64 (exact) up to the 32-bit mask.
    key = _mix32(((tl.load(NOISE_KEYS + row) + token_number * _STEP_STRIDE) & 0xFFFFFFFF).to(tl.uint32))
    bans_over = token_number >= tl.load(MIN_TOKENS + row)
    run_max = float("-inf")
    run_sum = 0.0
    best = float("-inf")
    best_index = 0
    for v0 in range(split * SPLIT, tl.minimum(vocab, (split + 1) * SPLIT), BLOCK):
        index = v0 + tl.arange(0, BLOCK)
        valid = index < vocab
        x = tl.load(LOGITS + row * stride_l + index, mask=valid, other=float("-inf")).to(tl.float32)
        # Same hash as ops.gumbel_noise, in native uint32 arithmetic.
        h = _mix32(key + index.to(tl.uint32) * _TOKEN_STRIDE)
        uniform = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        gumbel = -tl.log(-tl.log(uniform))
        allowed = valid & (x >= floor)
        for j in tl.static_range(NUM_BANNED):
            allowed = allowed & ((index != tl.load(BANNED + row * stride_b + j)) | bans_over)
        score = tl.where(allowed, x * inv_t + gumbel * noise_scale, float("-inf"))
        if PROCESSED:
            scored = tl.where(allowed, x * inv_t, float("-inf"))
        else:
            scored = x
        new_max = tl.maximum(run_max, tl.max(scored, axis=0))
        # A slice may allow no token at all: its max stays -inf, and exp(-inf - 0) adds nothing.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(scored - shift), axis=0)
        run_max = new_max
        chunk_best = tl.max(score, axis=0)
        chunk_index = v0 + tl.argmax(score, axis=0)
        take = chunk_best > best
        best_index = tl.where(take, chunk_index, best_index)
        best = tl.where(take, chunk_best, best)
    out = row * num_splits + split
    tl.store(PART_MAX + out, run_max)
    tl.store(PART_SUM + out, run_sum)
    tl.store(PART_BEST + out, best)
    tl.store(PART_INDEX + out, best_index)


@triton.jit
def _sample_combine_kernel(
    LOGITS, TEMPERATURE, PART_MAX, PART_SUM, PART_BEST, PART_INDEX, TOKENS, LOGPROBS, stride_l, num_splits,
    SPLITS_PAD: tl.constexpr, PROCESSED: tl.constexpr,
):  # fmt: skip
    """A row's token (the best slice's best; the lowest index on ties, as argmax) and its log-prob."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    valid = splits < num_splits
    part = row * num_splits + splits
    maxes = tl.load(PART_MAX + part, mask=valid, other=float("-inf"))
    sums = tl.load(PART_SUM + part, mask=valid, other=0.0)
    top = tl.max(maxes, axis=0)
    lse = top + tl.log(tl.sum(sums * tl.exp(maxes - top), axis=0))
    best = tl.load(PART_BEST + part, mask=valid, other=float("-inf"))
    winner = tl.argmax(best, axis=0)
    token = tl.sum(tl.where(splits == winner, tl.load(PART_INDEX + part, mask=valid, other=0), 0), axis=0)
    tl.store(TOKENS + row, token.to(tl.int64))
    logit = tl.load(LOGITS + row * stride_l + token).to(tl.float32)
    if PROCESSED:
        logit = logit * _inverse_temperature(tl.load(TEMPERATURE + row))
    tl.store(LOGPROBS + row, logit - lse)


SAMPLE_SPLIT = 4096  # vocabulary entries per program: a 150k vocabulary spreads over ~40 programs per row


def sample_tokens(logits, params, step, min_logit, processed=False):
    """``ops.sample_tokens`` (``params`` an ``ops.SamplingRows``) in two launches: vocabulary slices, then rows."""
    temperature, banned = params.temperature, params.banned
    rows, vocab = logits.shape
    dev = logits.device
    splits = triton.cdiv(vocab, SAMPLE_SPLIT)
    part_max, part_sum, part_best = (torch.empty(rows, splits, dtype=torch.float32, device=dev) for _ in range(3))
    part_index = torch.empty(rows, splits, dtype=torch.int32, device=dev)
    _sample_split_kernel[(rows, splits)](
        logits, temperature, min_logit, params.noise_keys, params.first_steps, banned, params.min_tokens,
        part_max, part_sum, part_best, part_index, step, logits.stride(0), banned.stride(0), vocab, splits,
        NUM_BANNED=banned.shape[1], SPLIT=SAMPLE_SPLIT, BLOCK=1024, PROCESSED=processed, num_warps=4,
    )  # fmt: skip
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _sample_combine_kernel[(rows,)](
        logits, temperature, part_max, part_sum, part_best, part_index, tokens, logprobs, logits.stride(0), splits,
        SPLITS_PAD=triton.next_power_of_2(splits), PROCESSED=processed, num_warps=1,
    )  # fmt: skip
    return tokens, logprobs
