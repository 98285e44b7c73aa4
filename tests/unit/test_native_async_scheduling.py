"""Asynchronous scheduling in the native engine: decode steps launched ahead give the synchronous loop's outputs."""

import pytest
import torch

from arctic_rl_core.config import ArcticRLClientConfig
from arctic_rl_core.engines.sampling.native import NativeEngine
from arctic_rl_core.engines.sampling.native.config import EngineConfig
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from arctic_rl_core.server.manager import sampling_options

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300], [7] * 21]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("async") / "qwen2", TinySpec(family="qwen2"))


def _engine(path, async_scheduling: bool, **options) -> NativeEngine:
    options = {"max_model_len": 96, "max_num_seqs": 8, "block_size": 4, **options}
    return NativeEngine(str(path), SamplingEngineOptions(extra={"async_scheduling": async_scheduling}, **options))


def _record_launches(engine: NativeEngine) -> list[bool]:
    """Per ``runner.run`` call: whether its inputs were a launched step's tokens still on the device."""
    launches = []
    run = engine.runner.run

    def recording(batch, previous=None):
        launches.append(previous is not None)
        return run(batch, previous)

    engine.runner.run = recording
    return launches


def _drive(engine: NativeEngine, requests: list[tuple[list[int], SamplingParams]], late: tuple) -> dict:
    """Every request's completions; ``late`` joins after three steps, while decode steps are in flight."""
    outputs = {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, request_id=i)
    for _ in range(3):
        outputs.update({o.request_id: o.completions for o in engine.step()})
    engine.add_request(*late, request_id="late")
    while engine.has_unfinished():
        outputs.update({o.request_id: o.completions for o in engine.step()})
    return outputs


def test_decode_steps_are_launched_before_the_last_ones_tokens_are_read(model):
    engine = _engine(model, async_scheduling=True)
    launches = _record_launches(engine)
    engine.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=8, ignore_eos=True), request_id="r")
    engine.step()  # prefill
    engine.step()  # the first decode step, launched and left on the device
    assert engine._launched is not None
    assert all(s.has_pending_token for s in engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()
    # Prefill, then 7 decode steps: each after the first took its inputs from the step before it.
    assert launches == [False, False] + [True] * 6
    assert engine._launched is None and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_outputs_equal_the_synchronous_loop_when_sequences_stop_at_different_steps(model):
    probe = _engine(model, async_scheduling=False)
    seeded = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    sampled = probe.generate([PROMPTS[0]], seeded)[0]
    # Stop tokens the three completions sample at steps 3, 8 and 13 end each of them by then.
    stop = [sampled[0].token_ids[3], sampled[1].token_ids[8], sampled[2].token_ids[13]]
    requests = [
        (PROMPTS[0], seeded.model_copy(update={"ignore_eos": False, "stop_token_ids": stop})),
        (PROMPTS[1], SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=9, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=True)),
    ]
    late = (PROMPTS[1] + [400], SamplingParams(max_tokens=6, temperature=1.0, seed=2, ignore_eos=True))
    results = {}
    for async_scheduling in (False, True):
        engine = _engine(model, async_scheduling)
        launches = _record_launches(engine)
        results[async_scheduling] = _drive(engine, requests, late)
        assert any(launches) == async_scheduling
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finish_steps = {len(c.token_ids) for c in results[True][0]}
    assert len(finish_steps) > 1 and {c.finish_reason for c in results[True][0]} == {"stop"}
    assert results[True].keys() == results[False].keys()
    for key, completions in results[False].items():
        for got, want in zip(results[True][key], completions, strict=True):
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids, want.text, want.finish_reason, want.stop_reason,
            )  # fmt: skip
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs))


def test_blocks_completed_by_pending_tokens_are_cached_under_their_sampled_tokens(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=4, ignore_eos=True)
    hits = {}
    for async_scheduling in (False, True):
        engine = _engine(model, async_scheduling)
        completion = engine.generate([PROMPTS[1]], params)[0][0]
        before = engine.prefix_cache_stats()["hit_tokens"]
        # The prompt's 3 tokens and the first 9 sampled ones fill three blocks: all were registered in decode.
        engine.generate([PROMPTS[1] + completion.token_ids[:9] + [1, 2]], params.model_copy(update={"max_tokens": 1}))
        hits[async_scheduling] = engine.prefix_cache_stats()["hit_tokens"] - before
    assert hits == {False: 12, True: 12}


def test_a_request_joining_mid_decode_never_hits_a_block_whose_last_kv_is_still_unwritten(model):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    generated = _engine(model, async_scheduling=False).generate([prompt], greedy)[0][0].token_ids
    # Extends the running generation across several full blocks, so it hits the ones that generation filled.
    follow = prompt + generated[:9] + [42, 43]
    follow_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = _engine(model, False, enable_prefix_caching=False).generate([follow], follow_params)[0][0]
    for steps_before in range(1, 10):
        hits = {}
        for async_scheduling in (False, True):
            engine = _engine(model, async_scheduling)
            engine.runner.kv_cache.fill_(3.0)  # an unwritten slot then reads as garbage, not as zeros
            engine.add_request(prompt, greedy, request_id="running")
            for _ in range(steps_before):
                engine.step()
            engine.add_request(follow, follow_params, request_id="joining")
            outputs = {}
            while engine.has_unfinished():
                outputs.update({o.request_id: o.completions for o in engine.step()})
            got = outputs["joining"][0]
            assert got.token_ids == want.token_ids, (steps_before, async_scheduling)
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs))
            hits[async_scheduling] = engine.prefix_cache_stats()["hit_tokens"]
        assert hits[True] == hits[False], steps_before


def test_an_abort_while_a_step_is_in_flight_frees_the_blocks_and_returns_nothing(model):
    engine = _engine(model, async_scheduling=True)
    engine.add_request(PROMPTS[2], SamplingParams(n=2, max_tokens=40, ignore_eos=True), request_id="gone")
    for _ in range(3):
        assert engine.step() == []
    assert engine._launched is not None
    engine.abort_request("gone")
    assert engine.step() == []
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_vllm_config_turns_async_scheduling_off_and_rejects_a_non_bool(model):
    def engine_config(vllm_config):
        config = ArcticRLClientConfig(model_name=str(model), training_gpus=1, vllm_config=vllm_config)
        return EngineConfig.from_options(str(model), sampling_options(config, "cpu"))

    assert engine_config(None).async_scheduling is True
    assert engine_config({"async_scheduling": False}).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        engine_config({"async_scheduling": "yes"})
