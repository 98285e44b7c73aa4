"""The engine loop lets concurrent callers share one native-engine batch, with the same results."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from arctic_rl_core.engines.sampling.engine_loop import EngineLoop
from arctic_rl_core.engines.sampling.native import NativeEngine
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = NativeEngine(tiny_model, SamplingEngineOptions(max_model_len=128, gpu_memory_utilization=0.05))
    yield engine
    engine.shutdown()


def test_concurrent_submits_match_one_batched_generate(engine):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=3)
    expected = engine.generate(prompts, params)
    loop = EngineLoop(engine)
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: loop.submit(p, params).result(timeout=60), prompts))
        assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in expected]
        assert loop.call(lambda e: e.weight_norm()) == pytest.approx(engine.weight_norm())
    finally:
        loop.stop()


def test_a_bad_request_fails_only_its_caller(engine):
    loop = EngineLoop(engine)
    try:
        bad = loop.submit([], SamplingParams(max_tokens=2))
        good = loop.submit([5, 6], SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(ValueError):
            bad.result(timeout=60)
        assert len(good.result(timeout=60)[0].token_ids) >= 1
    finally:
        loop.stop()


def test_a_refused_prompt_fails_its_whole_call_and_nothing_of_it_runs(engine):
    loop = EngineLoop(engine)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        futures = loop.submit_all([[5, 6], [], [7, 8]], params)
        for future in futures:
            with pytest.raises(ValueError, match=r"^prompt 1 of 3: prompt_token_ids is empty"):
                future.result(timeout=60)
        assert not loop.call(lambda e: e.has_unfinished())  # nothing in flight: sleep() may follow at once
        # The first prompt, added before the refusal, is aborted: the next call's step runs only its own.
        assert len(loop.submit([9, 10], params).result(timeout=60)[0].token_ids) == 4
        assert not loop.call(lambda e: e.has_unfinished())
    finally:
        loop.stop()


@pytest.mark.parametrize("stop_id", [-1, 5000])
def test_a_stop_token_id_outside_the_vocabulary_fails_only_its_caller_naming_the_field(engine, stop_id):
    vocab = engine.config.spec.vocab_size
    loop = EngineLoop(engine)
    try:
        good = loop.submit([5, 100, 300, 50], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        # min_tokens > 0 makes the sampler ban the id by index: it must never reach a step.
        bad = loop.submit([7, 8, 9], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[3, stop_id]))
        with pytest.raises(ValueError, match=rf"stop_token_ids holds \[{stop_id}\]; expected ints in \[0, {vocab}\)"):
            bad.result(timeout=60)
        assert len(good.result(timeout=60)[0].token_ids) == 20
    finally:
        loop.stop()
