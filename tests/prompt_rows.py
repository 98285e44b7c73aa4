"""(prompt, response) token lists as the [B, T] tensors a forward takes, for ZoRRo's tests."""

from __future__ import annotations

import torch


def right_padded(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask, and ``select``: the positions whose next token is a response token."""
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, (prompt, response) in enumerate(rows):
        input_ids[b, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        attention_mask[b, : len(prompt) + len(response)] = 1
        select[b, len(prompt) - 1 : len(prompt) + len(response) - 1] = True
    return input_ids, attention_mask, select
