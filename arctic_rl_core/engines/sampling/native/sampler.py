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


def min_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int | None = None
):
    """Per row, the smallest raw logit top-k then top-p (over ``softmax(logits / T)``) keep.

    ``width``: the largest top-k, when every row has one. Top-p then looks at no
    more than that many of the best logits, so only those are sorted.
    """
    vocab = logits.shape[1]
    if width is not None and width < vocab:
        values = logits.float().topk(width, dim=-1).values
    else:
        values = logits.float().sort(dim=-1, descending=True).values
    ranks = torch.arange(values.shape[1], device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=values.shape[1]), values.shape[1])
    in_top_k = ranks[None, :] < k[:, None]
    probs = torch.softmax(values.masked_fill(~in_top_k, float("-inf")) / temperature[:, None], dim=-1)
    # A token is kept while the mass strictly before it is below top_p; the first always is.
    keep = in_top_k & (probs.cumsum(dim=-1) - probs < top_p[:, None])
    last = keep.sum(dim=-1).clamp_min(1) - 1
    return values.gather(1, last[:, None])[:, 0]


class HostSlots:
    """Pinned host buffers the steps' tokens and log-probs are copied into, used in turn.

    A step's slot is written again ``SLOTS`` steps later. The engine reads a
    step before it launches the step after next (asynchronous scheduling keeps
    one step ahead), so a slot is always read before it is reused; a read that
    came too late would raise rather than return another step's tokens.
    """

    SLOTS = 3

    def __init__(self, rows: int, pin_memory: bool = True):
        self.tokens = [torch.empty(rows, dtype=torch.int64, pin_memory=pin_memory) for _ in range(self.SLOTS)]
        self.logprobs = [torch.empty(rows, dtype=torch.float32, pin_memory=pin_memory) for _ in range(self.SLOTS)]
        self.uses = [0] * self.SLOTS
        self.calls = 0

    @property
    def rows(self) -> int:
        return len(self.tokens[0])

    def take(self) -> tuple[int, int]:
        """The next slot and the use it is on."""
        slot = self.calls % self.SLOTS
        self.calls += 1
        self.uses[slot] += 1
        return slot, self.uses[slot]


@dataclass
class SampledTokens:
    """One step's tokens and log-probs: on the device, where the next decode step can read them as its
    inputs, and on their way to the host (a copy the step's caller waits for only in ``values``)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    _slots: HostSlots | None = None
    _slot: tuple[int, int] = (0, 0)  # (slot, use) in ``_slots``
    _copied: torch.cuda.Event | None = None
    _values: tuple[list[int], list[float]] | None = None

    @classmethod
    def copy_to_host(cls, tokens: torch.Tensor, logprobs: torch.Tensor, slots: HostSlots) -> "SampledTokens":
        """Start the copy into the next of ``slots``."""
        slot, use = slots.take()
        rows = len(tokens)
        slots.tokens[slot][:rows].copy_(tokens, non_blocking=True)
        slots.logprobs[slot][:rows].copy_(logprobs, non_blocking=True)
        copied = None
        if tokens.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        return cls(tokens, logprobs, slots, (slot, use), copied)

    def values(self) -> tuple[list[int], list[float]]:
        """Token ids and log-probs as lists; waits for the device if the step is still running."""
        if self._values is not None:
            return self._values
        if self._slots is None:
            self._values = self.tokens.tolist(), self.logprobs.tolist()
            return self._values
        slot, use = self._slot
        if self._slots.uses[slot] != use:
            raise RuntimeError("a sampled step was read after its host buffer was reused by a later step")
        if self._copied is not None:
            self._copied.synchronize()
        rows = len(self.tokens)
        self._values = self._slots.tokens[slot][:rows].tolist(), self._slots.logprobs[slot][:rows].tolist()
        return self._values


def upload(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` on ``device`` through one copy of their bytes packed together: a batch's small tables
    cost one transfer, not one each. Each comes back as a view of the packed copy, 8-byte aligned."""
    spans, chunks, offset = [], [], 0
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        spans.append((offset, len(raw)))
        chunks += [raw, torch.zeros(-len(raw) % 8, dtype=torch.uint8)]
        offset += len(raw) + len(chunks[-1])
    packed = torch.cat(chunks).to(device)
    return [packed[o : o + n].view(t.dtype).view(t.shape) for (o, n), t in zip(spans, tensors)]


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], device: torch.device, processed_logprobs: bool = False):
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        self.processed_logprobs = processed_logprobs
        # Per-batch constants, rebuilt only when the batch changes; ``_calls`` counts the batch's steps.
        self._batch_key: tuple[int, ...] = ()
        self._rows: ops.SamplingRows | None = None
        self._first_step = 0  # the first row's first_steps, to check that the count still holds
        self._calls = 0
        self._no_floor: torch.Tensor | None = None
        self._filtered: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None] | None = None
        self._slots: HostSlots | None = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        key = tuple(s.seq_id for s in seqs)
        # Each call samples one token per row, so the rows' token numbers are the first call's plus the calls.
        if key != self._batch_key or seqs[0].num_completion_tokens != self._first_step + self._calls:
            self._prepare_batch(key, seqs)
        step, self._calls = self._calls, self._calls + 1
        floor = self._no_floor
        if self._filtered is not None:
            index, top_k, top_p, width = self._filtered
            kept = min_logits(logits[index], self._rows.temperature[index], top_k, top_p, width)
            floor = floor.index_put((index,), kept)
        tokens, logprobs = ops.sample_tokens(logits, self._rows, step, floor, self.processed_logprobs)
        if not tokens.is_cuda:
            return SampledTokens(tokens, logprobs)  # on the host already, read directly
        if self._slots is None or self._slots.rows < len(seqs):
            self._slots = HostSlots(max(len(seqs), 2 * (self._slots.rows if self._slots else 0)))
        return SampledTokens.copy_to_host(tokens, logprobs, self._slots)

    def _prepare_batch(self, key: tuple[int, ...], seqs: list[Sequence]) -> None:
        params = [s.params for s in seqs]
        self._batch_key = key
        self._calls = 0
        self._first_step = seqs[0].num_completion_tokens
        # The kernels take temperature 0 as greedy: a greedy row's tiny temperature must not reach 1 / temperature.
        temperatures = [0.0 if p.greedy else p.temperature for p in params]
        # As vLLM bans them before min_tokens: stop ids and EOS, even under ignore_eos (-1 pads).
        bans = [list(p.stop_token_ids) + self.eos_token_ids if p.min_tokens else [] for p in params]
        banned = torch.full((len(seqs), max(map(len, bans), default=0)), -1, dtype=torch.int32)
        for i, ids in enumerate(bans):
            banned[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k_enabled or p.top_p < 1.0)]
        top_ks = [params[i].top_k for i in filtered]
        (temperature, noise_keys, first_steps, banned, min_tokens, self._no_floor, index, top_k, top_p) = upload(
            self.device,
            torch.tensor(temperatures, dtype=torch.float32),
            torch.tensor([s.noise_key for s in seqs], dtype=torch.int64),
            torch.tensor([s.num_completion_tokens for s in seqs], dtype=torch.int64),
            banned,
            torch.tensor([p.min_tokens for p in params], dtype=torch.int64),
            torch.full((len(seqs),), float("-inf")),
            torch.tensor(filtered, dtype=torch.int64),
            torch.tensor(top_ks, dtype=torch.int64),
            torch.tensor([params[i].top_p for i in filtered], dtype=torch.float32),
        )
        self._rows = ops.SamplingRows(temperature, noise_keys, first_steps, banned, min_tokens)
        self._filtered = None
        if filtered:
            self._filtered = (
                index,
                top_k,
                top_p,
                max(top_ks) if min(top_ks) > 0 else None,  # a partial sort does when every row has a top-k
            )
