"""The model's fused operations: torch on CPU (and as the reference), Triton kernels on CUDA.

Each function computes the same thing on either device; the torch versions
round where Hugging Face's layers round, so CPU outputs match HF in float32.
On CUDA the fused kernels cut a decode step's launches from about thirty per
layer to six: the four projections (``decode_linear``, which also run the
norms between them, the rotary embedding with the KV-cache write and the
gated activation), attention and its merge.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

MASK32 = 0xFFFFFFFF


class DeferredNorm(NamedTuple):
    """``rms_norm(stream) * weight`` as a fused decode projection hands it on: not yet divided by the rms.

    ``scaled`` is ``stream * weight`` in the model's dtype, and ``sum_squares`` the stream's sums of squares
    per row, one float32 row ``[parts, block_m]`` per column tile of the projection that wrote it. The
    projection that reads it scales its output rows by ``1 / rms`` instead (``decode_linear``'s ``row_norm``),
    so no kernel runs between the two; ``apply_norm`` materialises it for any other reader. Its products
    round once where Hugging Face's norm rounds twice (normalised, then weighted): a bf16 difference.
    float32 models never take this path, so their outputs still match Hugging Face's.
    """

    scaled: torch.Tensor
    sum_squares: torch.Tensor
    eps: float


Normed = torch.Tensor | DeferredNorm  # a norm's output, materialised or deferred


def linear(x: Normed, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: on CUDA, decode batches of a half-precision model take ``decode_linear``."""
    tiles = _decode_tiles(x, weight.shape[0])
    if tiles is None:
        return F.linear(apply_norm(x), weight, bias)
    return _decode_linear(x, weight, bias, tiles=tiles)


def gated_linear(x: Normed, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection ``x @ weight.T`` (gate rows first), in one kernel on CUDA."""
    tiles = _decode_tiles(x, weight.shape[0] // 2, gated=True)
    if tiles is None:
        return silu_and_mul(F.linear(apply_norm(x), weight))
    return _decode_linear(x, weight, gated=True, tiles=tiles)


def linear_into_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[Normed, torch.Tensor]:
    """``(norm(y + residual), y + residual)`` for ``y = x @ weight.T + bias``: a projection that ends a block.

    Where ``decode_linear`` takes the projection, it adds into ``residual`` in place and defers the norm to
    the projection that reads it (``DeferredNorm``): one launch instead of two.
    """
    tiles = _decode_tiles(x, weight.shape[0])
    if tiles is None:
        return rms_norm(linear(x, weight, bias), norm_weight, eps, residual)
    scaled, sum_squares = _decode_linear(x, weight, bias, tiles=tiles, into_residual=(residual, norm_weight))
    return DeferredNorm(scaled, sum_squares, eps), residual


def apply_norm(x: Normed) -> torch.Tensor:
    """A norm's output as a tensor: ``x`` itself, or a deferred norm divided by each row's rms."""
    if isinstance(x, torch.Tensor):
        return x
    if x.scaled.is_cuda:
        from arctic_rl_core.engines.sampling.native import triton_ops

        return triton_ops.scale_rows(x.scaled, x.sum_squares, x.eps)
    rows, cols = x.scaled.shape
    inv_rms = torch.rsqrt(x.sum_squares[:, :rows].sum(0) / cols + x.eps)
    return (x.scaled.float() * inv_rms[:, None]).to(x.scaled.dtype)


class RotaryStore(NamedTuple):
    """What ``rotary_and_store`` takes besides the q/k/v projection's output, in its order."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    num_heads: int
    num_kv_heads: int


# Head sizes whose q/k/v projection rotates in its epilogue: a tile is one head, and Triton's tiles are powers of
# two. 128-wide weight tiles spill ~700 bytes per thread in the sm_90a build (64-wide ones none), so models with
# 128-dim heads keep the separate rotary kernel until that is timed.
ROTARY_HEAD_TILES = (16, 32, 64)


def qkv_rotary_and_store(
    x: Normed, weight: torch.Tensor, bias: torch.Tensor | None, store: RotaryStore
) -> torch.Tensor:
    """``rotary_and_store(x @ weight.T + bias, *store)``: the rotated queries of the fused q/k/v projection.

    Where ``decode_linear`` takes the projection in tiles of one head (``ROTARY_HEAD_TILES``), it rotates and
    stores each head as it finishes it: one launch instead of two.
    """
    head_dim = store.k_cache.shape[-1]
    tiles = _decode_tiles(x, weight.shape[0], block_n=head_dim) if head_dim in ROTARY_HEAD_TILES else None
    if tiles is None:
        return rotary_and_store(linear(x, weight, bias), *store)
    return _decode_linear(x, weight, bias, tiles=tiles, rotary=store)


def _decode_linear(x: Normed, weight: torch.Tensor, bias=None, **options):
    """``decode_linear``, launched as a programmatic dependent where the device supports it."""
    from arctic_rl_core.engines.sampling.native import decode_linear
    from arctic_rl_core.zorro.attention.triton_attention import supports_pdl

    if isinstance(x, DeferredNorm):
        options["row_norm"] = (x.sum_squares, x.eps)
        x = x.scaled
    return decode_linear.decode_linear(x, weight, bias, pdl=supports_pdl(x.device), **options)


def _decode_tiles(x: Normed, n: int, gated: bool = False, block_n: int | None = None):
    """``decode_linear``'s tiles for this call, or None for ``F.linear``.

    float32 models keep cuBLAS, whose products match Hugging Face's; so do
    batches too tall for a decode kernel.
    """
    if isinstance(x, DeferredNorm):
        x = x.scaled
    if not x.is_cuda or x.dtype == torch.float32 or x.dim() != 2:
        return None
    from arctic_rl_core.engines.sampling.native import decode_linear

    return decode_linear.pick_tiles(x.shape[0], n, x.shape[1], decode_linear.num_sms(x.device), gated, block_n)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; without ``residual``, ``(norm(x), x)``."""
    if x.is_cuda:
        from arctic_rl_core.engines.sampling.native import triton_ops

        return triton_ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    return _rms_norm_torch(x, weight, eps), x


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Split ``qkv``, apply the per-head norms (Qwen3) and rotary embedding, write k and v to their cache slots.

    ``cos``/``sin`` are ``[max_positions, head_dim // 2]`` float32 tables.
    Tokens with a negative slot (graph padding) are not written. Returns the
    rotated queries ``[tokens, num_heads, head_dim]``.
    """
    if qkv.is_cuda:
        from arctic_rl_core.engines.sampling.native import triton_ops

        return triton_ops.rotary_and_store(
            qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, num_heads, num_kv_heads
        )
    head_dim = k_cache.shape[-1]
    tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    v = v.reshape(tokens, num_kv_heads, head_dim)
    if q_norm is not None:
        q = _rms_norm_torch(q, q_norm, eps)
        k = _rms_norm_torch(k, k_norm, eps)
    c = cos[positions].to(qkv.dtype)[:, None, :]
    s = sin[positions].to(qkv.dtype)[:, None, :]
    q = _rotate(q, c, s)
    k = _rotate(k, c, s)
    write = slots >= 0
    k_cache.flatten(0, 1).index_copy_(0, slots[write], k[write])
    v_cache.flatten(0, 1).index_copy_(0, slots[write], v[write])
    return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout (HF's ``rotate_half``), same op order as HF."""
    x1, x2 = x.chunk(2, dim=-1)
    cos2 = torch.cat([cos, cos], dim=-1)
    sin2 = torch.cat([sin, sin], dim=-1)
    return (x * cos2) + (torch.cat([-x2, x1], dim=-1) * sin2)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused ``[..., 2 * intermediate]`` projection."""
    if gate_up.is_cuda:
        from arctic_rl_core.engines.sampling.native import triton_ops

        return triton_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values below 2**32.

    Multipliers are below 2**31 so every product fits in int64 exactly; the
    Triton sampler computes the same function in uint32.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & MASK32
    return x ^ (x >> 16)


STEP_STRIDE = 0x9E3779B9  # a row's key at step s: mix32(noise_key + s * STEP_STRIDE)
TOKEN_STRIDE = 0x61C88647  # token v's bits under a row's key k: mix32(k + v * TOKEN_STRIDE)


def row_keys(noise_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit key of its noise row at ``steps`` (int64 tensors)."""
    return mix32((noise_keys + steps * STEP_STRIDE) & MASK32)


def gumbel_noise(row_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[rows, vocab]``, a pure function of each row's 32-bit key and the token index."""
    index = torch.arange(vocab_size, device=row_keys.device, dtype=torch.int64)
    bits = mix32((row_keys[:, None] + index[None, :] * TOKEN_STRIDE) & MASK32)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


class SamplingRows(NamedTuple):
    """A batch's sampling parameters, one entry per row, on the device; they change only with the batch.

    A row samples its token number ``first_steps + step`` at a batch's ``step``-th call: its noise and
    whether ``banned`` applies (before ``min_tokens``) follow from that, with nothing uploaded per step.
    """

    temperature: torch.Tensor  # float32; 0 is greedy
    noise_keys: torch.Tensor  # int64 holding 32-bit keys
    first_steps: torch.Tensor  # int64: completion tokens the row had at the batch's first call
    banned: torch.Tensor  # int32 [rows, width], -1 pads: the ids ``min_tokens`` bans (stop ids and EOS)
    min_tokens: torch.Tensor  # int64: ``banned`` applies while the row's token number is below it


def sample_tokens(
    logits: torch.Tensor, rows: SamplingRows, step: int, min_logit: torch.Tensor, processed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob: under the raw logits, or with ``processed`` under the distribution
    it was drawn from (``logits / temperature`` renormalised over the allowed tokens; greedy rows at 1).

    Rows with temperature 0 take the argmax; others take the Gumbel-max of
    ``logits / temperature`` (an exact sample of the softmax). Tokens whose raw
    logit is below ``min_logit`` (top-k / top-p) or banned are never chosen.
    """
    if logits.is_cuda:
        from arctic_rl_core.engines.sampling.native import triton_ops

        return triton_ops.sample_tokens(logits, rows, step, min_logit, processed)
    logits = logits.float()
    steps = rows.first_steps + step
    allowed = logits >= min_logit[:, None]
    banning = (rows.banned >= 0) & (steps < rows.min_tokens)[:, None]
    which, slots = banning.nonzero(as_tuple=True)
    allowed[which, rows.banned[which, slots].long()] = False
    temperature = rows.temperature
    greedy = temperature == 0
    # Multiplying by the reciprocal, as the kernel does, keeps both devices' choices identical.
    scaled = logits * torch.where(greedy, 1.0, 1.0 / temperature)[:, None]
    noise = gumbel_noise(row_keys(rows.noise_keys, steps), logits.shape[1])
    scores = torch.where(greedy[:, None], scaled, scaled + noise)
    tokens = scores.masked_fill(~allowed, float("-inf")).argmax(dim=-1)
    scored = scaled.masked_fill(~allowed, float("-inf")) if processed else logits
    return tokens, scored.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(scored, dim=-1)
