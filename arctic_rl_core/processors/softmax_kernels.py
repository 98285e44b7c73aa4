"""Fused Triton kernels (GPU) for per-row softmax statistics: log p(label), entropy, and their gradient.

Each row of logits [N, V] is read once forward and once backward, in tiles of
``block_v`` columns, with float32 math whatever the input dtype. Forward keeps an
online max, sum of exponentials and exponential-weighted sum of shifted logits,
so it writes log-sum-exp, log p(label) and entropy without a second pass.
Backward writes the gradient in the logits' dtype directly: nothing float32 of
size [N, V] ever exists. Imported on demand by ``post``: it compiles for the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Each program streams one row; wide tiles keep enough bytes in flight per SM.
MAX_BLOCK_V = 4096


@triton.jit
def _statistics_forward(
    LOGITS, LABELS, LOGSUMEXP, LOGPROBS, ENTROPY, vocab, stride_row,
    HAS_LABELS: tl.constexpr, WANT_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)  # running max
    s = tl.zeros((), tl.float32)  # sum of exp(x - m)
    t = tl.zeros((), tl.float32)  # sum of exp(x - m) * (x - m): shifted, so entropy keeps its digits
    for start in range(0, vocab, BLOCK_V):
        x = tl.load(logits + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While every logit so far is -inf, shift by 0 to avoid inf - inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - shift) * LOG2E)
        e = tl.exp2((x - shift) * LOG2E)
        if WANT_ENTROPY:
            # Moving the reference from m to shift adds (m - shift) to every earlier term; s = 0 before any.
            rebase = tl.where(s > 0, s * (m - shift), 0.0)
            # A -inf logit has p = 0 and adds p log p = 0, not 0 * -inf.
            t = alpha * (t + rebase) + tl.sum(tl.where(e > 0, e * (x - shift), 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log2(s) * LN2
    logsumexp = m + log_s
    tl.store(LOGSUMEXP + row, logsumexp)
    if HAS_LABELS:
        label = tl.load(LABELS + row)
        # An out-of-range label reads nothing and gives NaN rather than another row's memory.
        picked = tl.load(logits + label, mask=(label >= 0) & (label < vocab), other=float("nan")).to(tl.float32)
        tl.store(LOGPROBS + row, picked - logsumexp)
    else:
        tl.store(LOGPROBS + row, -logsumexp)
    if WANT_ENTROPY:
        # H = logsumexp - E_p[x] = log s - E_p[x - m]
        tl.store(ENTROPY + row, log_s - t / s)
    else:
        tl.store(ENTROPY + row, 0.0)


@triton.jit
def _statistics_backward(
    LOGITS, LABELS, LOGSUMEXP, ENTROPY, GRAD_LOGPROBS, GRAD_ENTROPY, GRAD_LOGITS, vocab, stride_row, stride_grad_row,
    HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_row
    grad_logits = GRAD_LOGITS + row * stride_grad_row
    cols = tl.arange(0, BLOCK_V)
    logsumexp = tl.load(LOGSUMEXP + row)
    g_logprob = 0.0
    label = -1
    if HAS_GRAD_LOGPROBS:
        g_logprob = tl.load(GRAD_LOGPROBS + row).to(tl.float32)
        label = tl.load(LABELS + row)
    g_entropy = 0.0
    entropy = 0.0
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(GRAD_ENTROPY + row).to(tl.float32)
        entropy = tl.load(ENTROPY + row)
    for start in range(0, vocab, BLOCK_V):
        j = start + cols
        valid = j < vocab
        log_p = tl.load(logits + j, mask=valid, other=float("-inf")).to(tl.float32) - logsumexp
        p = tl.exp2(log_p * LOG2E)
        # d log p_label / dx_j = [j = label] - p_j;  dH / dx_j = -p_j (log p_j + H)
        if HAS_GRAD_ENTROPY:
            # p_j = 0 (a -inf logit) contributes 0, not 0 * -inf.
            grad = tl.where(p > 0, -p * (g_logprob + g_entropy * (log_p + entropy)), 0.0)
        else:
            grad = -p * g_logprob
        if HAS_GRAD_LOGPROBS:
            grad += tl.where(j == label, g_logprob, 0.0)
        tl.store(grad_logits + j, grad.to(GRAD_LOGITS.dtype.element_ty), mask=valid)


def _block_v(vocab: int, block_v: int | None) -> int:
    return block_v or min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))


def _num_warps(block_v: int) -> int:
    # 4 warps over 4096 columns measured fastest forward on an H200 (backward is at copy speed for all)
    return max(1, min(4, block_v // 512))


def softmax_statistics(
    logits: Tensor,
    labels: Tensor | None,
    want_entropy: bool,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: float32 (log-sum-exp, log p(label) (or -log-sum-exp without labels), entropy (or 0))."""
    rows, vocab = logits.shape
    labels = None if labels is None else labels.contiguous()
    logsumexp, logprobs, entropy = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        block = _block_v(vocab, block_v)
        _statistics_forward[(rows,)](
            logits, logsumexp if labels is None else labels, logsumexp, logprobs, entropy, vocab, logits.stride(0),
            HAS_LABELS=labels is not None, WANT_ENTROPY=want_entropy, BLOCK_V=block,
            num_warps=num_warps or _num_warps(block),
        )  # fmt: skip
    return logsumexp, logprobs, entropy


def softmax_statistics_backward(
    logits: Tensor,
    labels: Tensor | None,
    logsumexp: Tensor,
    entropy: Tensor,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """d(sum g_logprob * log p(label) + g_entropy * H) / d logits, in the logits' dtype; a None grad counts as 0."""
    if grad_logprobs is None and grad_entropy is None:
        return torch.zeros_like(logits)
    rows, vocab = logits.shape
    labels = None if labels is None else labels.contiguous()
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if rows:
        block = _block_v(vocab, block_v)
        _statistics_backward[(rows,)](
            logits, logsumexp if labels is None else labels, logsumexp, entropy,
            logsumexp if grad_logprobs is None else grad_logprobs.contiguous(),
            logsumexp if grad_entropy is None else grad_entropy.contiguous(),
            grad, vocab, logits.stride(0), grad.stride(0),
            HAS_GRAD_LOGPROBS=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, BLOCK_V=block,
            num_warps=num_warps or _num_warps(block),
        )  # fmt: skip
    return grad
