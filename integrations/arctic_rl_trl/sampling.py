"""Completions from the arctic sampling engine, in the form TRL's generation step returns them.

TRL repeats each prompt ``num_generations`` times in a row. Such a run is
sent once with ``n = num_generations``, so the sampler shares the prompt's
KV cache across the group (and Forest Cascade Attention reads it once per
decode step). Each call carries a seed derived from ``GRPOConfig.seed`` and
the call's index, so a run is reproducible.

The sampler seeds a request's completions from (seed, completion index), as
vLLM does, so two requests with the same prompt under one seed would get the
same completions. TRL samples every row independently: a prompt that heads
several groups of one call (the dataset holds it twice) is therefore sent
once, with ``n = num_generations * groups``, and its completions are dealt
back to the groups in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trl import GRPOConfig

from arctic_rl_trl.event_loop import EventLoopThread


@dataclass(frozen=True)
class SamplerSettings:
    """GRPOConfig's generation options as the sampler's ``sampling_params`` (checked by ``compat``)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    seed: int

    @classmethod
    def from_args(cls, args: GRPOConfig, eos_token_ids: Sequence[int]) -> "SamplerSettings":
        return cls(
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop_token_ids=tuple(eos_token_ids),
            seed=args.seed,
        )

    def params(self, n: int, seed: int | None) -> dict:
        return {
            "n": n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "seed": seed,
            "logprobs": True,
        }


def repeated_groups(prompt_ids: Sequence[Sequence[int]], size: int) -> list[list[int]] | None:
    """The distinct prompts when ``prompt_ids`` is consecutive runs of ``size`` identical prompts, else None."""
    if size < 2 or len(prompt_ids) % size:
        return None
    heads = []
    for start in range(0, len(prompt_ids), size):
        head = list(prompt_ids[start])
        if any(list(p) != head for p in prompt_ids[start + 1 : start + size]):
            return None
        heads.append(head)
    return heads


class ArcticSampler:
    """``generate`` calls for TRL's ``_generate_single_turn``: token ids in, token ids and log-probs out."""

    def __init__(self, client, loop: EventLoopThread, settings: SamplerSettings):
        self.client, self.loop, self.settings = client, loop, settings
        self.calls = 0

    def complete(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per entry of ``prompt_ids``, in order, with the sampler's per-token log-probs."""
        groups = repeated_groups(prompt_ids, num_generations)
        if groups is not None:
            completions = self._complete_groups(groups, num_generations)
        else:
            # Identical prompts under one seed would get identical completions, so this path samples unseeded.
            outputs = self._generate([list(p) for p in prompt_ids], n=1, seed=None)
            completions = [completion for result in outputs for completion in result["outputs"]]
        return [c["token_ids"] for c in completions], [c["logprobs"] for c in completions]

    def _complete_groups(self, groups: list[list[int]], size: int) -> list[dict]:
        """``size`` completions per group, in group order; a prompt heading several groups is one request."""
        distinct: dict[tuple[int, ...], int] = {}
        for head in groups:
            distinct[tuple(head)] = distinct.get(tuple(head), 0) + 1
        outputs = self._generate_counts([list(head) for head in distinct], [size * c for c in distinct.values()])
        pending = {head: iter(result["outputs"]) for head, result in zip(distinct, outputs, strict=True)}
        return [next(pending[tuple(head)]) for head in groups for _ in range(size)]

    def _generate_counts(self, prompts: list[list[int]], counts: list[int]) -> list[dict]:
        """One seeded call per distinct ``n`` (usually a single call), results in the order of ``prompts``."""
        seed = self._next_seed()
        results: list[dict | None] = [None] * len(prompts)
        for n in sorted(set(counts)):
            indices = [i for i, count in enumerate(counts) if count == n]
            for i, result in zip(indices, self._generate([prompts[i] for i in indices], n=n, seed=seed), strict=True):
                results[i] = result
        return results

    def _next_seed(self) -> int:
        self.calls += 1
        return (self.settings.seed << 32) + self.calls

    def _generate(self, prompts: list[list[int]], n: int, seed: int | None) -> list[dict]:
        params = self.settings.params(n, seed)
        return self.loop.run(self.client.generate(prompt_token_ids=prompts, sampling_params=params))
