"""Sampling on raw logits: top-k / top-p floors, seeded Gumbel noise, raw and processed log-probs."""

import pytest
import torch

from arctic_rl_core.engines.sampling.native import ops
from arctic_rl_core.engines.sampling.native.sampler import HostSlots, SampledTokens, min_logits, noise_key, upload


def sampling_rows(temperature, banned, min_tokens=None, first_steps=0) -> ops.SamplingRows:
    """Rows seeded 0, 1, ...; ``banned`` applies while a row's token number is below ``min_tokens`` (default:
    always)."""
    rows = len(temperature)
    return ops.SamplingRows(
        temperature=torch.as_tensor(temperature, dtype=torch.float32),
        noise_keys=torch.tensor([noise_key(s) for s in range(rows)]),
        first_steps=torch.full((rows,), first_steps, dtype=torch.int64),
        banned=banned,
        min_tokens=torch.full((rows,), 2**40) if min_tokens is None else torch.as_tensor(min_tokens),
    )


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    floor = min_logits(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert floor.tolist() == [2.0]


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p_at_the_sampling_temperature():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep_two = min_logits(logits, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([0.8]))
    assert torch.allclose(keep_two, logits[0, 1])
    # At a high temperature the distribution flattens: 0.8 of the mass needs three tokens.
    keep_three = min_logits(logits, torch.tensor([5.0]), torch.tensor([-1]), torch.tensor([0.8]))
    assert torch.allclose(keep_three, logits[0, 2])


def test_a_partial_sort_to_the_largest_top_k_gives_the_full_sorts_floors():
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)) * 2
    logits[0, :40] = 5.0  # ties at the cut
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3])
    top_k = torch.tensor([50, 7, 200, 1, 200, 3000])
    top_p = torch.tensor([1.0, 0.9, 0.6, 0.5, 0.99, 0.8])
    full = min_logits(logits, temperature, top_k, top_p)
    assert torch.equal(min_logits(logits, temperature, top_k, top_p, width=3000), full)
    assert torch.equal(min_logits(logits[:5], temperature[:5], top_k[:5], top_p[:5], width=200), full[:5])


def test_samples_stay_inside_the_floor_and_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -9.0]]).repeat(4000, 1)
    floor = torch.full((4000,), 0.0)
    rows = sampling_rows(torch.ones(4000), torch.full((4000, 1), 1, dtype=torch.int32))
    tokens, logprobs = ops.sample_tokens(logits, rows, 0, floor)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[1] == counts[3] == 0  # banned, and below the floor
    share = counts[0] / 4000  # e^2 / (e^2 + e^0) with token 1 banned
    assert abs(share - 0.8808) < 0.03
    raw = torch.log_softmax(logits[0], -1)
    assert torch.allclose(logprobs[tokens == 0], raw[0]) and torch.allclose(logprobs[tokens == 2], raw[2])


def test_processed_logprobs_score_the_distribution_the_token_was_drawn_from():
    """vLLM's processed_logprobs: logits / temperature renormalised over what the floor and bans leave;
    a greedy row's logits are not scaled."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -9.0], [2.0, 1.0, 0.0, -9.0], [0.5, 3.0, 1.0, 2.0]])
    temperature = torch.tensor([0.5, 2.0, 0.0])
    floor = torch.tensor([0.0, float("-inf"), float("-inf")])
    rows = sampling_rows(temperature, torch.tensor([[1], [-1], [1]], dtype=torch.int32))
    tokens, raw = ops.sample_tokens(logits, rows, 0, floor)
    same_tokens, processed = ops.sample_tokens(logits, rows, 0, floor, processed=True)
    assert torch.equal(tokens, same_tokens)
    allowed = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)
    scale = torch.tensor([2.0, 0.5, 1.0])[:, None]
    expected = torch.log_softmax((logits * scale).masked_fill(~allowed, float("-inf")), -1)
    rows = torch.arange(3)
    torch.testing.assert_close(processed, expected[rows, tokens])
    torch.testing.assert_close(raw, torch.log_softmax(logits, -1)[rows, tokens])
    assert tokens[2] == 3  # greedy: the best token left once token 1 is banned


def test_noise_is_a_function_of_key_and_token_number_only():
    keys = torch.tensor([noise_key(7), noise_key(8)])
    a = ops.gumbel_noise(ops.row_keys(keys, torch.tensor([3, 3])), 50)
    b = ops.gumbel_noise(ops.row_keys(keys[:1], torch.tensor([3])), 50)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], a[1])
    assert ops.row_keys(keys[:1], torch.tensor([3])) != ops.row_keys(keys[:1], torch.tensor([4]))


def test_a_batch_step_is_a_token_number_for_noise_and_for_the_min_tokens_ban():
    logits = torch.zeros(64, 8)
    banned = torch.tensor([[0, 1, 2, 3]] * 64, dtype=torch.int32)
    later = ops.sample_tokens(logits, sampling_rows(torch.ones(64), banned, [5] * 64, first_steps=2), 1, logits[:, 0])
    same = ops.sample_tokens(logits, sampling_rows(torch.ones(64), banned, [5] * 64, first_steps=3), 0, logits[:, 0])
    assert torch.equal(later[0], same[0])
    assert (later[0] >= 4).all()  # token number 3 < min_tokens: ids 0-3 banned
    free = ops.sample_tokens(logits, sampling_rows(torch.ones(64), banned, [5] * 64, first_steps=3), 2, logits[:, 0])
    assert (free[0] < 4).any()  # token number 5: min_tokens reached, the ban is over


def test_steps_come_back_through_reused_host_slots_and_a_read_after_reuse_raises():
    """(On CUDA the slots are pinned and the copies asynchronous; tests/gpu checks that.)"""
    slots = HostSlots(4, pin_memory=False)
    steps = [
        SampledTokens.copy_to_host(torch.full((3,), i), torch.full((3,), -float(i)), slots)
        for i in range(HostSlots.SLOTS)
    ]
    assert steps[0].values() == ([0] * 3, [0.0] * 3)
    later = SampledTokens.copy_to_host(torch.full((2,), 9), torch.full((2,), -9.0), slots)  # slot 0 again
    assert steps[0].values() == ([0] * 3, [0.0] * 3)  # read before the reuse: kept
    assert later.values() == ([9] * 2, [-9.0] * 2)
    assert steps[2].values() == ([2] * 3, [-2.0] * 3)
    SampledTokens.copy_to_host(torch.zeros(1), torch.zeros(1), slots)  # slot 1 again
    with pytest.raises(RuntimeError, match="reused"):
        steps[1].values()


def test_upload_returns_each_table_unchanged_from_one_packed_copy():
    """Odd byte lengths (3 int8s, 5 float32s) and empty tables keep every later view 8-byte aligned and exact."""
    tables = [
        torch.tensor([1, -2, 3], dtype=torch.int8),
        torch.arange(5, dtype=torch.float32) / 3,
        torch.tensor([[2**40, -1], [7, 0]], dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.full((2, 0), -1, dtype=torch.int32),
        torch.tensor([[-1, 4, 5]], dtype=torch.int32),
    ]
    uploaded = upload(torch.device("cpu"), *tables)
    base = uploaded[0].untyped_storage().data_ptr()
    for before, after in zip(tables, uploaded):
        assert after.dtype == before.dtype and after.shape == before.shape and torch.equal(after, before)
        assert after.untyped_storage().data_ptr() == base  # one buffer, so one copy to a device
