"""(prompt, response) token lists as the [B, T] tensors a forward takes, for ZoRRo's tests."""

from __future__ import annotations

import torch


def padded(
    rows: list[tuple[list[int], list[int]]], padding: str = "right"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask, and ``select`` (the positions whose next token is a response token), each row
    padded on the ``padding`` side ("left" or "right")."""
    if padding not in ("left", "right"):
        raise ValueError(f"padding must be 'left' or 'right', got {padding!r}")
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, (prompt, response) in enumerate(rows):
        n = len(prompt) + len(response)
        start = width - n if padding == "left" else 0
        input_ids[b, start : start + n] = torch.tensor(prompt + response)
        attention_mask[b, start : start + n] = 1
        select[b, start + len(prompt) - 1 : start + n - 1] = True
    return input_ids, attention_mask, select
