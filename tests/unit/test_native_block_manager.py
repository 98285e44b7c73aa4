"""Paged-KV bookkeeping: shared prefix blocks, reference counts, cache hits, eviction order, preemption."""

import pytest

from arctic_rl_core.engines.sampling.native.block_manager import BlockManager
from arctic_rl_core.engines.sampling.native.config import EngineConfig
from arctic_rl_core.engines.sampling.native.scheduler import Scheduler
from arctic_rl_core.engines.sampling.native.sequence import Sequence, SequenceStatus
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

BS = 4


def _seq(tokens, max_tokens=8):
    return Sequence("r", 0, tokens, SamplingParams(max_tokens=max_tokens), noise_key=0, block_size=BS)


def _admit(manager, seq):
    cached = manager.num_cached_blocks(seq)
    assert manager.can_allocate(seq, cached)
    manager.allocate(seq)
    return cached


def test_a_second_sequence_shares_the_cached_full_blocks_before_its_last_token():
    manager = BlockManager(16, BS, enable_prefix_caching=True)
    first, second = _seq(list(range(10))), _seq(list(range(10)))
    assert _admit(manager, first) == 0
    assert _admit(manager, second) == 2  # positions 0-7; block 2 holds the last token and is computed again
    assert first.block_table[:2] == second.block_table[:2]
    assert first.block_table[2] != second.block_table[2]
    assert second.num_cached_tokens == 8
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert manager.stats.to_dict() == {"queried_tokens": 20, "hit_tokens": 8}


def test_a_block_aligned_prompt_recomputes_its_last_block():
    manager = BlockManager(16, BS, enable_prefix_caching=True)
    _admit(manager, _seq(list(range(8))))
    assert _admit(manager, _seq(list(range(8)))) == 1


def test_freed_blocks_stay_cached_and_the_tail_is_evicted_before_the_prefix():
    manager = BlockManager(4, BS, enable_prefix_caching=True)
    first = _seq(list(range(13)))  # 4 blocks: the whole cache
    _admit(manager, first)
    manager.deallocate(first)
    assert manager.num_free_blocks == 4
    _admit(manager, _seq([99] * 3))  # takes one block: the freed tail (block 3) goes first
    again = _seq(list(range(13)))
    assert manager.num_cached_blocks(again) == 3
    assert not manager.can_allocate(again, 3)  # reviving 3 cached blocks plus a new last one needs all 4


def test_reset_forgets_every_registration_but_keeps_blocks_in_use():
    manager = BlockManager(16, BS, enable_prefix_caching=True)
    first = _seq(list(range(10)))
    _admit(manager, first)
    manager.reset_prefix_cache()
    assert manager.num_cached_blocks(_seq(list(range(10)))) == 0
    assert manager.ref_counts[first.block_table[0]] == 1


def test_without_prefix_caching_nothing_is_shared():
    manager = BlockManager(16, BS, enable_prefix_caching=False)
    _admit(manager, _seq(list(range(10))))
    assert _admit(manager, _seq(list(range(10)))) == 0


def test_decode_appends_blocks_and_registers_the_ones_it_completes():
    manager = BlockManager(16, BS, enable_prefix_caching=True)
    seq = _seq(list(range(7)))
    _admit(manager, seq)
    seq.append(7, 0.0)  # the 8th token completes block 1 when it is fed
    manager.may_append(seq)
    assert len(seq.block_table) == 2
    seq.append(8, 0.0)
    manager.may_append(seq)
    assert len(seq.block_table) == 3
    assert manager.num_cached_blocks(_seq(list(range(9)) + [5])) == 2


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("bm") / "m", TinySpec(family="llama"))
    return EngineConfig.from_options(str(path), SamplingEngineOptions(max_model_len=64, block_size=BS))


def test_decode_preempts_the_newest_sequence_when_blocks_run_out_and_readmits_it_from_the_cache(config):
    manager = BlockManager(5, BS, enable_prefix_caching=True)
    scheduler = Scheduler(config, manager)
    old, new = _seq(list(range(8))), _seq(list(range(100, 108)))
    scheduler.add(old)
    scheduler.add(new)
    assert scheduler.schedule().seqs == [old, new]  # prefill: 2 blocks each, 1 left
    for seq in (old, new):
        seq.append(1, 0.0)
    batch = scheduler.schedule()  # old takes the last block; new cannot grow and is preempted
    assert batch.seqs == [old] and not batch.is_prefill
    assert new.status == SequenceStatus.WAITING and new.block_table == []
    old.append(2, 0.0)
    scheduler.finish(old, "length")
    readmitted = scheduler.schedule()
    assert readmitted.is_prefill and readmitted.seqs == [new]
    assert new.num_cached_tokens == 8  # its prompt blocks were still cached
