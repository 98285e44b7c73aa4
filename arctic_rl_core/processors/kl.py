"""Per-token estimators of KL(current policy || reference) from log-probs of sampled tokens.

With log r = ref_logp - logp (Schulman, "Approximating KL divergence", 2020):

=====  ======================  =============================================
k1     -log r                  unbiased, high variance, can be negative
k2     (log r)^2 / 2           biased, low variance, its gradient is right
k3     (r - 1) - log r         unbiased, low variance, always >= 0
abs    |log r|                 verl's "abs"
=====  ======================  =============================================

verl's names are accepted for the same estimators: ``kl`` = k1, ``mse`` = k2,
``low_var_kl`` = k3. k3 follows verl 0.9.1's ``kl_penalty`` exactly, including
its clamps: log r to [-20, 20] before the exponential, the estimate to
[-10, 10] after it. ``k3_unclamped`` is the same formula without them, as TRL
computes it: past an estimate of 10 (log r above about 2.6) the clamped one
has no gradient, the unclamped one keeps pulling the policy back.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3", "k3_unclamped", "abs", "kl", "mse", "low_var_kl"]

_CANONICAL = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Elementwise KL estimate; differentiable in ``logprobs``."""
    name = _CANONICAL.get(estimator, estimator)
    log_ratio = ref_logprobs - logprobs
    if name == "k1":
        return -log_ratio
    if name == "k2":
        return 0.5 * log_ratio.square()
    if name == "abs":
        return log_ratio.abs()
    if name == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    if name == "k3_unclamped":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl estimator {estimator!r} is not one of {KLEstimator.__args__}")
