"""Forest attention as a few large FlashAttention calls merged by log-sum-exp, with an exact backward.

A packed token sees the tokens of its own node causally and every token of
each ancestor node in full. So the forest's attention splits into passes that
FlashAttention runs on its fast path, with no copy of an ancestor's K/V per
descendant:
- ``own``: each node's tokens as one causal sequence (queries = keys, contiguous
  in the packed order, nothing gathered);
- one ``ancestor`` pass per tree level: the descendants of each node at that
  level, all at once, attend to the node's own tokens without a mask. For a
  GRPO batch this is one call: all G responses' queries over the prompt's keys.
  A node's descendants and its own tokens are both contiguous in the packed
  order, so each such ``Span`` runs on slices of q, k and v: nothing is gathered.
Within one pass every query appears at most once, so the passes merge exactly:
``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logaddexp_i(lse_i)``, in
place, one span at a time (one fused kernel on CUDA).

Backward runs each pass's own FlashAttention backward, handing it the merged
output and log-sum-exp: with those, its ``P = exp(S - lse)`` and
``D = rowsum(dO * O)`` are the whole attention's, so each pass returns the exact
gradient of its share of the keys (the identity ring attention relies on).

``FlashVarlenOps`` calls ATen's FlashAttention varlen kernels for the own pass
(CUDA, fp16/bf16); ``CudnnOps`` runs each span through cuDNN's attention (on an
H200, 1.5x FlashAttention-2's forward and 1.8x its backward on a 16384 x 8192
GRPO span); ``ReferenceOps`` computes both in plain torch, so the split, merge
and backward are tested on CPU in fp32 against dense attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from arctic_rl_core.zorro.train.forest import PrefixForest, to_device


@dataclass(frozen=True)
class Pass:
    """Varlen sequences of one pass: queries and keys as packed indices, sequence after sequence."""

    q_index: torch.Tensor  # int64 [total_q]
    k_index: torch.Tensor  # int64 [total_k]
    cu_q: torch.Tensor  # int32 [sequences + 1]
    cu_k: torch.Tensor  # int32 [sequences + 1]
    max_q: int
    max_k: int
    causal: bool
    bounds: tuple[tuple[int, int, int, int], ...]  # per sequence (q start, q end, k start, k end), on the host

    @classmethod
    def of(cls, queries: list[np.ndarray], keys: list[np.ndarray], causal: bool) -> Pass:
        q_lengths = np.array([len(q) for q in queries])
        k_lengths = np.array([len(k) for k in keys])
        cu_q = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(k_lengths)]).astype(np.int32)
        return cls(
            q_index=torch.from_numpy(np.concatenate(queries)),
            k_index=torch.from_numpy(np.concatenate(keys)),
            cu_q=torch.from_numpy(cu_q),
            cu_k=torch.from_numpy(cu_k),
            max_q=int(q_lengths.max()),
            max_k=int(k_lengths.max()),
            causal=causal,
            bounds=tuple(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())),
        )

    def to(self, device: torch.device) -> Pass:
        tensors = to_device(device, self.q_index, self.k_index, self.cu_q, self.cu_k)
        return Pass(*tensors, self.max_q, self.max_k, self.causal, self.bounds)


# Descendants [q0, q1) of one node attending to its own tokens [k0, k1), in packed positions.
Span = tuple[int, int, int, int]


@dataclass(frozen=True)
class SplitLayout:
    """The forest's passes: every node's own causal sequence, then one ancestor pass (its spans) per tree level."""

    own: Pass
    ancestors: tuple[tuple[Span, ...], ...]

    @classmethod
    def of(cls, forest: PrefixForest) -> SplitLayout:
        own = [np.arange(n.offset, n.offset + n.length) for n in forest.nodes]
        levels: list[int] = []
        by_level: dict[int, list[Span]] = {}
        for node in forest.nodes:  # preorder: a parent's level is known before its children's
            level = 0 if node.parent < 0 else levels[node.parent] + 1
            levels.append(level)
            end_of_own = node.offset + node.length
            if node.subtree_end > end_of_own:  # has descendants: they all read this node's tokens in full
                by_level.setdefault(level, []).append((end_of_own, node.subtree_end, node.offset, end_of_own))
        ancestors = tuple(tuple(by_level[level]) for level in sorted(by_level))
        return cls(Pass.of(own, own, causal=True), ancestors)

    def to(self, device: torch.device) -> SplitLayout:
        return SplitLayout(self.own.to(device), self.ancestors)


class AttentionOps(Protocol):
    """Varlen attention with its log-sum-exp, and a backward that takes the output and lse to use (the own pass)."""

    def forward(self, q, k, v, p: Pass, scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """[total_q, H, D] output, [H, total_q] float32 lse, and whatever ``backward`` needs of this call."""
        ...

    def backward(self, dout, q, k, v, out, lse, p: Pass, scale: float, state: Any) -> tuple[torch.Tensor, ...]: ...


class SpanOps(Protocol):
    """Unmasked attention of one span's queries over its keys (slices [n, H, D] and [m, H_kv, D])."""

    def span_forward(self, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """[n, H, D] output (any strides, last one 1), [H, n] float32 lse, and what ``span_backward`` needs."""
        ...

    def span_backward(self, dout, q, k, v, out, lse, scale: float, state: Any) -> tuple[torch.Tensor, ...]:
        """dq [n, H, D], dk and dv [m, H_kv, D] of the span, given the merged output and lse of its queries."""
        ...


class FlashVarlenOps:
    """ATen's FlashAttention-2 varlen forward and backward (CUDA, fp16/bf16; GQA handled by the kernel)."""

    def forward(self, q, k, v, p: Pass, scale: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, p.causal, False, scale=scale
        )
        if lse.dim() != 2:  # torch >= 2.4 returns the unpadded [H, total_q]; older kernels padded it
            raise RuntimeError(f"FlashAttention varlen returned a log-sum-exp of shape {list(lse.shape)}")
        return out, lse, (rng_state, unused)

    def backward(self, dout, q, k, v, out, lse, p: Pass, scale: float, state):
        rng_state, unused = state
        return torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse.contiguous(), p.cu_q, p.cu_k, p.max_q, p.max_k,
            0.0, p.causal, rng_state, unused, scale=scale,
        )  # fmt: skip


class CudnnOps:
    """cuDNN's fused attention, one call per span (no varlen); K/V heads expanded for GQA."""

    # One call per span pays off for a few long spans (GRPO groups), not for many short ones.
    MAX_SEQUENCES = 16

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and head_dim <= 128
            and torch.backends.cudnn.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")
            and torch.cuda.get_device_capability(device) >= (9, 0)
        )

    def span_forward(self, q, k, v, scale: float):
        heads = q.shape[1]
        out, lse, _, _, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(_repeat_heads(k, heads)), _bhsd(_repeat_heads(v, heads)), None, True, 0.0, False, False,
            scale=scale,
        )  # fmt: skip
        return out[0].transpose(0, 1), lse[0, :, :, 0], (max_q, max_k, seed, offset)

    def span_backward(self, dout, q, k, v, out, lse, scale: float, state):
        max_q, max_k, seed, offset = state
        heads, kv_heads = q.shape[1], k.shape[1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(_repeat_heads(k, heads)), _bhsd(_repeat_heads(v, heads)),
            _bhsd(out), lse.contiguous()[None, :, :, None], seed, offset, None, None, None, max_q, max_k,
            0.0, False, scale=scale,
        )  # fmt: skip
        return (
            dq[0].transpose(0, 1),
            dk[0].transpose(0, 1).unflatten(1, (kv_heads, -1)).sum(2),
            dv[0].transpose(0, 1).unflatten(1, (kv_heads, -1)).sum(2),
        )


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, H, S, D] without a copy (cuDNN takes the strides as they are)."""
    return x.transpose(0, 1)[None]


class ReferenceOps:
    """The same two functions in plain torch, one sequence at a time (exact in fp32; for tests and CPU)."""

    def forward(self, q, k, v, p: Pass, scale: float):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=_math_dtype(q))
        for qs, ks in _sequences(p):
            scores = self._scores(q[qs], k[ks], scale, p.causal)  # [H, lq, lk]
            lse[:, qs] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, qs, None])
            out[qs] = torch.einsum("hqk,khd->qhd", probs, _repeat_heads(v[ks], q.shape[1])).to(out.dtype)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, p: Pass, scale: float, state):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        heads, kv_heads = q.shape[1], k.shape[1]
        for qs, ks in _sequences(p):
            probs = torch.exp(self._scores(q[qs], k[ks], scale, p.causal) - lse[:, qs, None])
            grad_out = dout[qs]
            dv_full = torch.einsum("hqk,qhd->khd", probs, grad_out)
            dprobs = torch.einsum("qhd,khd->hqk", grad_out, _repeat_heads(v[ks], heads))
            delta = (grad_out * out[qs]).sum(-1).transpose(0, 1)[..., None]  # [H, lq, 1]
            dscores = probs * (dprobs - delta) * scale
            dq[qs] = torch.einsum("hqk,khd->qhd", dscores, _repeat_heads(k[ks], heads))
            dk_full = torch.einsum("hqk,qhd->khd", dscores, q[qs])
            dk[ks] = dk_full.unflatten(1, (kv_heads, -1)).sum(2)
            dv[ks] = dv_full.unflatten(1, (kv_heads, -1)).sum(2)
        return dq, dk, dv

    def span_forward(self, q, k, v, scale: float):
        n, m = len(q), len(k)
        return self.forward(q, k, v, _one_sequence(n, m), scale)

    def span_backward(self, dout, q, k, v, out, lse, scale: float, state):
        return self.backward(dout, q, k, v, out, lse, _one_sequence(len(q), len(k)), scale, state)

    @staticmethod
    def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
        scores = torch.einsum("qhd,khd->hqk", q, _repeat_heads(k, q.shape[1])) * scale
        if causal:  # aligned to the bottom right, as FlashAttention's varlen is
            lq, lk = q.shape[0], k.shape[0]
            visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        return scores


def _one_sequence(n: int, m: int) -> Pass:
    """A host-side pass of one unmasked sequence: n queries over m keys (for ``ReferenceOps``'s spans)."""
    empty = torch.empty(0, dtype=torch.int64)
    return Pass(empty, empty, empty, empty, n, m, causal=False, bounds=((0, n, 0, m),))


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _sequences(p: Pass):
    for q0, q1, k0, k1 in p.bounds:
        yield slice(q0, q1), slice(k0, k1)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    # Merges and gradient sums in float32 at least (float64 stays float64).
    return torch.promote_types(x.dtype, torch.float32)


def _weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse) as [tokens, H, 1], to scale a part's [tokens, H, D] output."""
    return torch.exp(lse_part - lse).transpose(0, 1)[..., None]


def merge_(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a span's ``part`` output [n, H, D] and ``part_lse`` [H, n] into ``out`` and ``lse``, in place."""
    if out.is_cuda:
        from arctic_rl_core.zorro.train.triton_merge import merge_attention_

        merge_attention_(out, lse, part, part_lse)
        return
    math = _math_dtype(out)
    merged = torch.logaddexp(lse, part_lse)
    out.copy_(out.to(math) * _weight(lse, merged) + part.to(math) * _weight(part_lse, merged))
    lse.copy_(merged)


class _SplitForestAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: SplitLayout, scale: float, ops: AttentionOps, span_ops: SpanOps):
        out, lse, own_state = ops.forward(q, k, v, layout.own, scale)
        states = []
        for spans in layout.ancestors:  # out and lse are this call's own fresh outputs: merged in place
            for q0, q1, k0, k1 in spans:
                part, part_lse, state = span_ops.span_forward(q[q0:q1], k[k0:k1], v[k0:k1], scale)
                merge_(out[q0:q1], lse[:, q0:q1], part, part_lse)
                states.append(state)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.ops, ctx.span_ops = layout, scale, ops, span_ops
        ctx.states = (own_state, *states)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        own_state, *states = ctx.states
        dout = dout.contiguous()
        dq, dk, dv = ctx.ops.backward(dout, q, k, v, out, lse, layout.own, scale, own_state)
        spans = (span for level in layout.ancestors for span in level)
        for (q0, q1, k0, k1), state in zip(spans, states):
            part = ctx.span_ops.span_backward(
                dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse[:, q0:q1], scale, state
            )
            # A key is in one span per level, a query in one per ancestor level: few adds each.
            dq[q0:q1] += part[0]
            dk[k0:k1] += part[1]
            dv[k0:k1] += part[2]
        return dq, dk, dv, None, None, None, None


def split_forest_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SplitLayout,
    scale: float | None,
    ops: AttentionOps,
    span_ops: SpanOps,
) -> torch.Tensor:
    """Packed [L, H, D] queries, [L, H_kv, D] keys/values -> [L, H, D]: each token over its forest ancestry.

    ``ops`` runs the own pass, ``span_ops`` each ancestor span.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _SplitForestAttention.apply(q, k, v, layout, scale, ops, span_ops)
