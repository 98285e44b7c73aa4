"""A prefix-cache reset (after a weight load) must leave no block computed before it findable afterwards."""

import pytest

from arctic_rl_core.engines.sampling.native import NativeEngine
from arctic_rl_core.engines.sampling.native.block_manager import BlockManager
from arctic_rl_core.engines.sampling.native.sequence import Sequence
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

BS = 4
OPTIONS = dict(max_model_len=64, max_num_seqs=8, block_size=BS)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_a_block_in_use_at_reset_is_not_registered_when_decode_completes_it():
    manager = BlockManager(8, BS, enable_prefix_caching=True)
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(), noise_key=0, block_size=BS)
    manager.allocate(seq)
    manager.reset_prefix_cache()  # block 0 holds KV of tokens 1, 2, 3 from before the reset
    seq.append(4, 0.0)
    manager.may_append(seq)  # token 4 completes block 0
    assert manager.num_cached_blocks(Sequence("s", 0, [1, 2, 3, 4, 5], SamplingParams(), 0, BS)) == 0
    manager.deallocate(seq)
    again = Sequence("t", 0, [1, 2, 3, 4, 5], SamplingParams(), 0, BS)
    manager.allocate(again)  # computed afresh: its blocks may be cached again
    manager.deallocate(again)
    assert manager.num_cached_blocks(Sequence("u", 0, [1, 2, 3, 4, 5], SamplingParams(), 0, BS)) == 1


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_weights_loaded_mid_generation_leave_no_stale_prefix_for_later_requests(tmp_path, tiny_model, async_scheduling):
    new_weights = build_tiny_model(tmp_path / "other", TinySpec(family="qwen2", seed=5))
    engine = NativeEngine(tiny_model, SamplingEngineOptions(extra={"async_scheduling": async_scheduling}, **OPTIONS))
    engine.add_request([100, 200, 300], GREEDY, request_id="old")
    engine.step()  # prefill under the old weights: block 0 holds three prompt tokens
    engine.load_weights(str(new_weights))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.completions for o in engine.step()})
    probe = [100, 200, 300, outputs["old"][0].token_ids[0], 7, 8]
    hits = engine.prefix_cache_stats()["hit_tokens"]
    got = engine.generate([probe], GREEDY)[0][0]
    assert engine.prefix_cache_stats()["hit_tokens"] == hits
    fresh = NativeEngine(str(new_weights), SamplingEngineOptions(**OPTIONS)).generate([probe], GREEDY)[0][0]
    assert got.token_ids == fresh.token_ids
    assert got.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
