"""Next tokens for a batch of sequences, each with its own sampling parameters.

Sampling is the Gumbel-max trick over ``logits / temperature`` with noise that
is a pure function of the sequence's seed, its step and the token index, so a
seeded completion is the same whatever else shares the batch. Top-k and top-p
become one floor on the raw logits per row. Log-probs are those of the raw
logits (before temperature, top-k and top-p), what the training engine computes
at temperature 1; or, in the engine's "processed_logprobs" mode, those of the
distribution each token was drawn from, as vLLM's mode of that name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_rl_core.engines.sampling.native import ops
from arctic_rl_core.engines.sampling.native.sequence import Sequence

MASK32 = ops.MASK32


def _mix32(x: int) -> int:
    """``ops.mix32`` on one Python int."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x31848BAB) & MASK32
    return x ^ (x >> 16)


def noise_key(seed: int) -> int:
    """A sequence's 32-bit noise key, from its 64-bit seed."""
    return _mix32(_mix32(seed & MASK32) ^ ((seed >> 32) & MASK32))


def row_key(key: int, step: int) -> int:
    """The key of step ``step``'s noise row."""
    return _mix32((key + step * 0x9E3779B9) & MASK32)


def min_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Per row, the smallest raw logit top-k then top-p (over ``softmax(logits / T)``) keep."""
    vocab = logits.shape[1]
    values = logits.float().sort(dim=-1, descending=True).values
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    in_top_k = ranks[None, :] < k[:, None]
    probs = torch.softmax(values.masked_fill(~in_top_k, float("-inf")) / temperature[:, None], dim=-1)
    # A token is kept while the mass strictly before it is below top_p; the first always is.
    keep = in_top_k & (probs.cumsum(dim=-1) - probs < top_p[:, None])
    last = keep.sum(dim=-1).clamp_min(1) - 1
    return values.gather(1, last[:, None])[:, 0]


@dataclass
class SampledTokens:
    """One step's tokens and log-probs: on the device, where the next decode step can read them as its
    inputs, and on their way to the host (a copy the step's caller waits for only in ``values``)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    _host: torch.Tensor | None = None  # [2, rows] float64, pinned
    _copied: torch.cuda.Event | None = None

    @classmethod
    def copy_to_host(cls, tokens: torch.Tensor, logprobs: torch.Tensor) -> "SampledTokens":
        if not tokens.is_cuda:
            return cls(tokens, logprobs)
        host = torch.empty((2, len(tokens)), dtype=torch.float64, pin_memory=True)
        host.copy_(torch.stack([tokens.double(), logprobs.double()]), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, logprobs, host, copied)

    def values(self) -> tuple[list[int], list[float]]:
        """Token ids and log-probs as lists; waits for the device if the step is still running."""
        if self._copied is None:
            return self.tokens.tolist(), self.logprobs.tolist()
        self._copied.synchronize()
        return self._host[0].long().tolist(), self._host[1].tolist()


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], device: torch.device, processed_logprobs: bool = False):
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        self.processed_logprobs = processed_logprobs
        # Per-batch constants (temperatures, top-k/top-p rows) are rebuilt only when the batch changes.
        self._batch_key: tuple[int, ...] = ()
        self._temperature: torch.Tensor | None = None
        self._filtered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        device = self.device
        key = tuple(s.seq_id for s in seqs)
        if key != self._batch_key:
            self._prepare_batch(key, seqs)
        temperature = self._temperature
        keys = torch.tensor([row_key(s.noise_key, s.num_completion_tokens) for s in seqs], dtype=torch.int64)
        keys = keys.to(device, non_blocking=True)
        banned = self._banned(seqs).to(device, non_blocking=True)
        floor = torch.full((len(seqs),), float("-inf"), device=device)
        if self._filtered is not None:
            index, top_k, top_p = self._filtered
            floor[index] = min_logits(logits[index], temperature[index], top_k, top_p)
        sampled = ops.sample_tokens(logits, temperature, floor, keys, banned, self.processed_logprobs)
        return SampledTokens.copy_to_host(*sampled)

    def _prepare_batch(self, key: tuple[int, ...], seqs: list[Sequence]) -> None:
        params = [s.params for s in seqs]
        self._batch_key = key
        # The kernels take temperature 0 as greedy: a greedy row's tiny temperature must not reach 1 / temperature.
        temperatures = [0.0 if p.greedy else p.temperature for p in params]
        self._temperature = torch.tensor(temperatures, dtype=torch.float32).to(self.device)
        filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k_enabled or p.top_p < 1.0)]
        self._filtered = None
        if filtered:
            self._filtered = (
                torch.tensor(filtered, device=self.device),
                torch.tensor([params[i].top_k for i in filtered], device=self.device),
                torch.tensor([params[i].top_p for i in filtered], dtype=torch.float32, device=self.device),
            )

    def _banned(self, seqs: list[Sequence]) -> torch.Tensor:
        """Per row, the tokens banned before ``min_tokens`` (-1 pads): stop ids and EOS, even under
        ``ignore_eos``, as vLLM bans them."""
        lists = [
            list(s.params.stop_token_ids) + self.eos_token_ids if s.num_completion_tokens < s.params.min_tokens else []
            for s in seqs
        ]
        width = max(map(len, lists), default=0)
        banned = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, ids in enumerate(lists):
            if ids:
                banned[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return banned
