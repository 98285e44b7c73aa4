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

from arctic_rl_core.models.forward import lm_head, selected_hidden_states

logger = logging.getLogger(__name__)

EntropyMode = Literal["none", "metric", "grad"]

# Rows of logits materialized at once when no gradient is needed ([rows, vocab] in float32).
_NO_GRAD_CHUNK_ROWS = 4096


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
) -> TokenOutputs:
    """Log-probs of ``input_ids[:, t+1]`` at every selected position t (and entropy there).

    ``post`` transforms logits rows before log-softmax (e.g. temperature).
    ``entropy="metric"`` computes it without gradient, ``"grad"`` with.
    ``zorro`` (a ZorroTrainConfig) packs shared prefixes when enabled.
    ``top_k`` > 0 also returns the k most likely next tokens and their log-probs.
    """
    from arctic_rl_core.processors import compute_entropy, compute_logprobs, compute_logprobs_and_entropy

    metrics: dict[str, tuple[float, float]] = {}
    if zorro is not None and zorro.enable:
        from arctic_rl_core.zorro.train import build_prefix_forest
        from arctic_rl_core.zorro.train import selected_hidden_states as packed_hidden_states

        forest = build_prefix_forest(input_ids, attention_mask, select)
        hidden = packed_hidden_states(
            model, input_ids, attention_mask, select, min_shared_tokens=zorro.min_shared_tokens, forest=forest
        )
        stats = forest.stats
        # Reduced as sum/weight across micro-batches and ranks: real tokens per computed token.
        metrics["zorro_train/dedup_ratio"] = (float(stats.tokens_real), float(max(stats.tokens_packed, 1)))
    else:
        hidden = selected_hidden_states(model, input_ids, attention_mask, select)
    labels = torch.roll(input_ids, shifts=-1, dims=1)[select]
    head = lm_head(model)
    grad = torch.is_grad_enabled()
    chunk = max(1, hidden.shape[0]) if grad else _NO_GRAD_CHUNK_ROWS
    logprob_rows, entropy_rows, top_rows = [], [], []
    for start in range(0, max(hidden.shape[0], 1), chunk):
        logits = head(hidden[start : start + chunk])
        if post is not None:
            logits = post(logits)
        rows_labels = labels[start : start + chunk]
        if entropy == "grad":
            # One pass over the logits for both, forward and backward.
            logprob, ent = compute_logprobs_and_entropy(logits, rows_labels)
            logprob_rows.append(logprob)
            entropy_rows.append(ent)
        else:
            logprob_rows.append(compute_logprobs(logits, rows_labels))
        if entropy == "metric":
            with torch.no_grad():
                entropy_rows.append(compute_entropy(logits.detach()))
        if top_k:
            top_rows.append(torch.topk(logits.detach().float().log_softmax(-1), top_k, dim=-1))
    logprobs = _scatter(torch.cat(logprob_rows), select)
    ent = _scatter(torch.cat(entropy_rows), select) if entropy_rows else None
    out = TokenOutputs(logprobs, ent, metrics=metrics)
    if top_k:
        grid = (*select.shape, top_k)
        values = torch.cat([t.values for t in top_rows])
        indices = torch.cat([t.indices for t in top_rows])
        out.top_logprobs = torch.zeros(grid, device=values.device).masked_scatter(select[..., None], values)
        out.top_ids = torch.zeros(grid, dtype=torch.long, device=values.device).masked_scatter(
            select[..., None], indices
        )
    return out


def _scatter(rows: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """[N] rows back into a zero [B, T] grid at ``select``, differentiably."""
    grid = torch.zeros(select.shape, dtype=torch.float32, device=rows.device)
    return grid.masked_scatter(select, rows.float())
