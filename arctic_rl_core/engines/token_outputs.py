"""Per-token log-probs and entropy from a causal LM, computed only where they are needed.

Shared by the training engine (``fwd_bwd``, ``fwd_no_grad``) and the
DeepSpeed log-prob engine, so both give the same numbers for the same text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from arctic_rl_core.models.forward import decoder_body, lm_head, selected_hidden_states
from arctic_rl_core.models.layer_graphs import replay_count

logger = logging.getLogger(__name__)

EntropyMode = Literal["none", "metric", "grad"]

# Logits materialized at once, in their own dtype (1 GiB: 3.5K rows of a 152K vocabulary in bf16).
LOGIT_CHUNK_BYTES = 1 << 30


@dataclass
class TokenOutputs:
    logprobs: torch.Tensor  # [B, T] float32, shifted; 0 outside ``select``
    entropy: torch.Tensor | None  # [B, T] float32, or None when not asked for
    top_ids: torch.Tensor | None = None  # [B, T, k] the k most likely next tokens
    top_logprobs: torch.Tensor | None = None  # [B, T, k] their log-probs
    # (sum, weight) pairs like a loss's metrics: ZoRRo's token counts when it packed the batch.
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)


def token_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: torch.Tensor,
    *,
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    entropy: EntropyMode = "none",
    zorro=None,
    top_k: int = 0,
    cuda_graphs: bool = False,
    agree_chunks: Callable[[int], int] | None = None,
) -> TokenOutputs:
    """Log-probs of ``input_ids[:, t+1]`` at every selected position t (and entropy there).

    ``post`` transforms logits rows before log-softmax (e.g. temperature).
    ``entropy="metric"`` computes it without gradient, ``"grad"`` with.
    ``zorro`` (a ZorroTrainConfig) packs shared prefixes when enabled.
    ``top_k`` > 0 also returns the k most likely next tokens and their log-probs.
    ``cuda_graphs`` replays the decoder layers as CUDA graphs where the shape repeats (with autograd on).
    ``agree_chunks`` maps this rank's number of LM head chunks to the number to run (``selected_logprobs``).
    """
    metrics: dict[str, tuple[float, float]] = {}
    labels = torch.roll(input_ids, shifts=-1, dims=1)[select]  # before the forward: it waits for the GPU
    cuda_graphs = cuda_graphs and torch.is_grad_enabled()  # graphs hold a backward: no-grad calls run eagerly
    replays = replay_count(decoder_body(model)) if cuda_graphs else 0
    if zorro is not None and zorro.enable:
        from arctic_rl_core.zorro.train import build_prefix_forest
        from arctic_rl_core.zorro.train import selected_hidden_states as packed_hidden_states

        forest = build_prefix_forest(input_ids, attention_mask, select)
        hidden = packed_hidden_states(
            model,
            input_ids,
            attention_mask,
            select,
            min_shared_tokens=zorro.min_shared_tokens,
            forest=forest,
            cuda_graphs=cuda_graphs,
        )
        stats = forest.stats
        # Reduced as sum/weight across micro-batches and ranks: real tokens per computed token.
        metrics["zorro_train/dedup_ratio"] = (float(stats.tokens_real), float(max(stats.tokens_packed, 1)))
    else:
        hidden = selected_hidden_states(model, input_ids, attention_mask, select, cuda_graphs=cuda_graphs)
    if cuda_graphs:
        # The share of micro-batches whose layers replayed graphs: whether the option pays here.
        metrics["cuda_graphs/replayed"] = (float(replay_count(decoder_body(model)) - replays), 1.0)
    head = lm_head(model)
    logprob_rows, entropy_rows, top = selected_logprobs(
        head, hidden, labels, post=post, entropy=entropy, top_k=top_k, agree_chunks=agree_chunks
    )
    logprobs = _scatter(logprob_rows, select)
    ent = _scatter(entropy_rows, select) if entropy_rows is not None else None
    out = TokenOutputs(logprobs, ent, metrics=metrics)
    if top_k:
        grid = (*select.shape, top_k)
        values, indices = top
        out.top_logprobs = torch.zeros(grid, device=values.device).masked_scatter(select[..., None], values)
        out.top_ids = torch.zeros(grid, dtype=torch.long, device=values.device).masked_scatter(
            select[..., None], indices
        )
    return out


def selected_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    entropy: EntropyMode = "none",
    top_k: int = 0,
    agree_chunks: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """``[N]`` log-probs of ``labels`` under ``head(hidden)`` (entropy and top-k as ``token_outputs`` asks).

    The [N, vocab] logits exist one chunk of rows at a time (``LOGIT_CHUNK_BYTES``).
    Under autograd each chunk's head, transform and statistics are recomputed
    in backward instead of kept (one extra head matmul): a GRPO batch of 16K
    response tokens and a 152K vocabulary would otherwise hold 10 GB of bf16
    logits and their gradient.

    ``agree_chunks`` maps this rank's number of chunks to the number it runs, chunks past its rows
    being empty: under ZeRO-3 each head call is a collective weight gather (and its backward another,
    with the gradient's reduction), so data-parallel ranks must all make the same calls.
    """
    weight = getattr(head, "weight", None)
    # ZeRO-3 partitions the weight; ``ds_shape`` keeps its full shape.
    vocab = (getattr(weight, "ds_shape", None) or weight.shape)[0] if weight is not None else 1
    rows = max(1, LOGIT_CHUNK_BYTES // (max(vocab, 1) * hidden.element_size()))
    chunks = max(-(-hidden.shape[0] // rows), 1)  # one head call even without rows
    if agree_chunks is not None:
        chunks = agree_chunks(chunks)
    chunked = torch.is_grad_enabled() and chunks > 1
    parts = []
    for start in range(0, chunks * rows, rows):
        args = (head, hidden[start : start + rows], labels[start : start + rows], post, entropy, top_k)
        parts.append(checkpoint(_chunk_outputs, *args, use_reentrant=False) if chunked else _chunk_outputs(*args))
    logprobs = torch.cat([p[0] for p in parts])
    ent = torch.cat([p[1] for p in parts]) if entropy != "none" else None
    top = (torch.cat([p[2].values for p in parts]), torch.cat([p[2].indices for p in parts])) if top_k else None
    return logprobs, ent, top


def _chunk_outputs(head, hidden, labels, post, entropy: EntropyMode, top_k: int):
    from arctic_rl_core.processors import compute_entropy, compute_logprobs, compute_logprobs_and_entropy

    logits = head(hidden)
    if post is not None:
        logits = post(logits)
    if entropy == "grad":
        # One pass over the logits for both, forward and backward.
        logprobs, ent = compute_logprobs_and_entropy(logits, labels)
    else:
        logprobs = compute_logprobs(logits, labels)
        ent = None
        if entropy == "metric":
            with torch.no_grad():
                ent = compute_entropy(logits.detach())
    top = torch.topk(logits.detach().float().log_softmax(-1), top_k, dim=-1) if top_k else None
    return logprobs, ent, top


def _scatter(rows: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """[N] rows back into a zero [B, T] grid at ``select``, differentiably."""
    grid = torch.zeros(select.shape, dtype=torch.float32, device=rows.device)
    return grid.masked_scatter(select, rows.float())
