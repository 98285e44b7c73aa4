"""TRL's optimizer slot, filled by the arctic training engine.

The Trainer steps ``self.optimizer`` once per optimizer step, between its
``on_pre_optimizer_step`` and ``on_optimizer_step`` callbacks, and drives an
LR scheduler over its parameter groups. ``ArcticOptimizer`` keeps that
contract without holding any state: ``step()`` runs ``client.step()`` on the
training engine (which clips, applies AdamW and advances its own schedule)
and then ``sync_weights()`` so the next rollout samples from the new policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class ArcticOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, step_engine: Callable[[], dict]):
        super().__init__(list(params), {"lr": lr})
        self._step_engine = step_engine
        self.last_step: dict | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ArcticOptimizer.step takes no closure: the loss is computed on the arctic engine")
        self.last_step = self._step_engine()
