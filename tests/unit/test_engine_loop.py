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
