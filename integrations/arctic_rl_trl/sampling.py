"""Completions from the arctic sampling engine, in the form TRL's generation step returns them.

TRL repeats each prompt ``num_generations`` times in a row. Such a run is
sent once with ``n = num_generations``, so the sampler shares the prompt's
KV cache across the group (and Forest Cascade Attention reads it once per
decode step). Each call carries a seed derived from ``GRPOConfig.seed`` and
the call's index, so a run is reproducible.
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
            outputs = self._generate(groups, n=num_generations, seed=self._next_seed())
        else:
            # Identical prompts under one seed would get identical completions, so this path samples unseeded.
            outputs = self._generate([list(p) for p in prompt_ids], n=1, seed=None)
        completions = [completion for result in outputs for completion in result["outputs"]]
        return [c["token_ids"] for c in completions], [c["logprobs"] for c in completions]

    def _next_seed(self) -> int:
        self.calls += 1
        return (self.settings.seed << 32) + self.calls

    def _generate(self, prompts: list[list[int]], n: int, seed: int | None) -> list[dict]:
        params = self.settings.params(n, seed)
        return self.loop.run(self.client.generate(prompt_token_ids=prompts, sampling_params=params))
