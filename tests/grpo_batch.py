"""A small fixed GRPO batch for tests that only need a training call to run."""

from __future__ import annotations

import torch


def grpo_batch() -> dict:
    """Four 64-token rows, responses from position 32, fixed advantages: a GRPO call's batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (4, 64), generator=g)
    response = torch.zeros_like(ids)
    response[:, 32:] = 1
    return {
        "args": [ids],
        "kwargs": {"attention_mask": torch.ones_like(ids)},
        "context": {"response_mask": response, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])},
    }


GRPO = {"loss_fn": "grpo", "config": {"eps_clip": 0.2}}
