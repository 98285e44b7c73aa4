"""ArcticSampler, the sampling side of ArcticGRPOTrainer, on the native sampling engine of a tiny model.

The sampler talks to a stand-in client whose ``generate`` is the native
engine's (what the sampling job runs), so no deployment is needed.
"""

from __future__ import annotations

import pytest

from arctic_rl_core.engines.sampling.native.engine import NativeEngine
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_trl.event_loop import EventLoopThread
from arctic_rl_trl.sampling import ArcticSampler, SamplerSettings

G = 4
A, B = [5, 6, 7, 8], [9, 10, 11]


class EngineClient:
    """The ``generate`` of an arctic client, answered by a native engine in this process."""

    def __init__(self, engine: NativeEngine):
        self.engine = engine
        self.calls: list[tuple[list[list[int]], dict]] = []

    async def generate(self, prompt_token_ids, sampling_params):
        self.calls.append((prompt_token_ids, sampling_params))
        results = self.engine.generate(prompt_token_ids, SamplingParams(**sampling_params))
        return [{"outputs": [c.to_dict() for c in completions]} for completions in results]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return NativeEngine(tiny_model, SamplingEngineOptions(device="cpu", enforce_eager=True))


@pytest.fixture
def loop():
    loop = EventLoopThread()
    yield loop
    loop.close()


def sampler(engine, loop, seed: int = 42) -> tuple[ArcticSampler, EngineClient]:
    client = EngineClient(engine)
    settings = SamplerSettings(max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=(), seed=seed)
    return ArcticSampler(client, loop, settings), client


def groups_of(completions: list[list[int]]) -> list[list[list[int]]]:
    return [completions[start : start + G] for start in range(0, len(completions), G)]


def test_groups_that_repeat_a_prompt_get_distinct_completions(engine, loop):
    """TRL samples every row independently: a prompt the dataset holds twice gets two different groups."""
    prompt_ids = [A] * G + [B] * G + [A] * G + [A] * G
    arctic, _ = sampler(engine, loop)
    completions, logprobs = arctic.complete(prompt_ids, G)
    assert len(completions) == len(logprobs) == len(prompt_ids)
    assert [len(c) for c in completions] == [len(lp) for lp in logprobs]
    rows_of_a = [tuple(c) for i, c in enumerate(completions) if prompt_ids[i] == A]
    assert len(set(rows_of_a)) == len(rows_of_a) == 3 * G, "every completion of the repeated prompt must differ"
    first, _, third, fourth = groups_of(completions)
    assert first != third and first != fourth and third != fourth


def test_repeated_prompts_stay_reproducible_and_unrepeated_batches_unchanged(engine, loop):
    """The same seed gives the same completions; a batch without repeats is one call with n = G, as before."""
    prompt_ids = [A] * G + [B] * G + [A] * G
    once, _ = sampler(engine, loop)[0].complete(prompt_ids, G)
    again, _ = sampler(engine, loop)[0].complete(prompt_ids, G)
    assert once == again

    arctic, client = sampler(engine, loop)
    distinct, _ = arctic.complete([A] * G + [B] * G, G)
    assert len(client.calls) == 1
    prompts, params = client.calls[0]
    assert prompts == [A, B] and params["n"] == G
    seed = params["seed"]
    expected = [
        c.token_ids for group in engine.generate([A, B], SamplingParams(**{**params, "seed": seed})) for c in group
    ]
    assert distinct == expected
