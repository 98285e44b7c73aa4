"""The split's fused log-sum-exp merge, run by Triton's interpreter on CPU, equals the torch merge.

The part comes as cuDNN returns it (a transposed view) and the running lse as a
column slice of the whole pass's, so the strides the engine passes are the ones
checked; head dim 80 is not a power of two.
"""

import torch

from tests.triton_interpreter import report, run_interpreted


def _case(dtype, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows, heads, total = 45, 3, 70
    out = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    part = torch.randn(1, heads, rows, head_dim, generator=gen).to(dtype)[0].transpose(0, 1)
    lse_all = torch.randn(heads, total, generator=gen) * 3
    lse = lse_all[:, 10 : 10 + rows]
    part_lse = torch.randn(heads, rows, generator=gen) * 3
    return out, lse, part, part_lse, lse_all


def check_merge_matches_torch(dtype_name: str, head_dim: int):
    from arctic_rl_core.zorro.train.triton_merge import merge_attention_

    dtype = getattr(torch, dtype_name)
    out, lse, part, part_lse, lse_all = _case(dtype, head_dim)
    merged_lse = torch.logaddexp(lse, part_lse)
    expected = (
        out.float() * torch.exp(lse - merged_lse).T[..., None]
        + part.float() * torch.exp(part_lse - merged_lse).T[..., None]
    ).to(dtype)
    untouched = lse_all[:, :10].clone()
    merge_attention_(out, lse, part, part_lse)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, merged_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(lse_all[:, :10], untouched)  # only the span's columns are written


CHECKS = {
    "float32-64": (check_merge_matches_torch, ("float32", 64)),
    "bfloat16-80": (check_merge_matches_torch, ("bfloat16", 80)),
}


def test_fused_merge_equals_the_torch_merge():
    results = run_interpreted(__file__)
    assert results == {name: "ok" for name in CHECKS}, results


if __name__ == "__main__":
    report(CHECKS)
