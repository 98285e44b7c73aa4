"""The engine's fused Triton kernels, run by Triton's interpreter on CPU, equal their torch twins in ``ops``.

The checks run in a fresh Python with ``TRITON_INTERPRET=1``
(``tests.triton_interpreter``); each test reads its result.
"""

import importlib

import torch

from arctic_rl_core.engines.sampling.native import ops
from tests.triton_interpreter import check_test, report


def _kernels():
    return importlib.import_module("arctic_rl_core.engines.sampling.native.triton_ops")


def check_fused_residual_rms_norm_matches_torch():
    kernels = _kernels()
    g = torch.Generator().manual_seed(0)
    x, residual, weight = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    for res in (None, residual):
        expected = ops.rms_norm(x, weight, 1e-6, None if res is None else res.clone())
        actual = kernels.rms_norm(x, weight, 1e-6, None if res is None else res.clone())
        torch.testing.assert_close(actual[0], expected[0])
        torch.testing.assert_close(actual[1], expected[1])


def check_rotary_and_cache_write_match_torch_and_skip_padding_slots(qk_norm, tokens=6):
    """Tokens in tiles of ``ROTARY_TOKENS`` (the last one partial), query, key and value heads each a program."""
    kernels = _kernels()
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.randint(0, 16, (tokens,), generator=g)
    freqs = torch.arange(16).float()[:, None] / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    norms = (torch.randn(dim, generator=g), torch.randn(dim, generator=g)) if qk_norm else (None, None)
    slots = torch.randperm(64, generator=g)[:tokens]
    slots[1::3] = -1  # padding rows write nothing
    caches = [torch.zeros(16, 4, kv_heads, dim) for _ in range(4)]
    q_ref = ops.rotary_and_store(qkv, positions, freqs.cos(), freqs.sin(), *norms, 1e-6, caches[0], caches[1],
                                 slots, heads, kv_heads)  # fmt: skip
    q_tri = kernels.rotary_and_store(qkv, positions.int(), freqs.cos(), freqs.sin(), *norms, 1e-6, caches[2],
                                     caches[3], slots, heads, kv_heads)  # fmt: skip
    torch.testing.assert_close(q_tri, q_ref)
    torch.testing.assert_close(caches[2], caches[0])
    torch.testing.assert_close(caches[3], caches[1])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert caches[2].flatten(0, 1)[untouched].abs().sum() == 0 and caches[3].flatten(0, 1)[untouched].abs().sum() == 0


def check_silu_and_mul_matches_torch():
    kernels = _kernels()
    gate_up = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), ops.silu_and_mul(gate_up))


def check_sampling_kernel_picks_the_same_tokens_and_logprobs_as_torch(processed):
    kernels = _kernels()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5000, generator=g) * 3
    logits[3, 3] = 50.0  # row 3 samples token 3 unless it is banned
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3])
    # Row 2's floor leaves a few tokens of the first 4096-entry slice and none of the second.
    min_logit = torch.tensor([float("-inf"), float("-inf"), logits[2, :4096].max().item() - 1.0, float("-inf")])
    banned = torch.tensor([[-1, -1], [5, int(logits[1].argmax())], [-1, -1], [3, -1]], dtype=torch.int32)
    rows = ops.SamplingRows(
        temperature=temperature,
        noise_keys=torch.tensor([1, 2, 3, 2**32 - 5]),
        first_steps=torch.tensor([0, 7, 2**20, 4]),
        banned=banned,
        min_tokens=torch.tensor([0, 9, 0, 10]),  # row 1 still banning at step 1; row 3 no longer at step 6
    )
    step = 1 if processed else 6
    expected = ops.sample_tokens(logits, rows, step, min_logit, processed)
    actual = kernels.sample_tokens(logits, rows, step, min_logit, processed)
    assert actual[0].tolist() == expected[0].tolist()
    torch.testing.assert_close(actual[1], expected[1])
    assert actual[0][0] == logits[0].argmax()
    assert torch.isfinite(actual[1]).all()
    if step + 7 < 9:  # row 1's token number is below its min_tokens: both ids are banned
        assert actual[0][1] not in (5, logits[1].argmax())
    assert (actual[0][3] == 3) == (step + 4 >= 10)  # row 3's ban of token 3 ends at token number 10


CHECKS = {
    "rms_norm": (check_fused_residual_rms_norm_matches_torch, ()),
    "rotary_store": (check_rotary_and_cache_write_match_torch_and_skip_padding_slots, (False,)),
    "rotary_store_qk_norm": (check_rotary_and_cache_write_match_torch_and_skip_padding_slots, (True,)),
    "rotary_store_tiles": (check_rotary_and_cache_write_match_torch_and_skip_padding_slots, (True, 37)),
    "silu_and_mul": (check_silu_and_mul_matches_torch, ()),
    "sampling": (check_sampling_kernel_picks_the_same_tokens_and_logprobs_as_torch, (False,)),
    "sampling_processed": (check_sampling_kernel_picks_the_same_tokens_and_logprobs_as_torch, (True,)),
}


test_kernel_under_the_interpreter = check_test(__file__, CHECKS)


if __name__ == "__main__":
    report(CHECKS)
