"""``BatchedCopy``'s chunk table and kernel, run by Triton's interpreter on CPU, copy every pair exactly.

Pairs of every kind in one call: multi-chunk tensors with tails, views that
are not 16-byte aligned, sizes that are not a multiple of 16 bytes, a dtype
change and a strided destination (the last four take the ``foreach`` path).
"""

import importlib

import torch

from tests.triton_interpreter import report, run_interpreted


def _pairs(seed: int, chunk_words: int):
    sizes = [4 * chunk_words * 3 + 8, 8, 7, 16, chunk_words * 4, 3]
    flat = torch.randn(sum(sizes) + 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    sources, offset = [], 8  # 16 bytes in: aligned; the 7- and 3-element sizes misalign what follows them
    for n in sizes:
        sources.append(flat[offset : offset + n])
        offset += n
    dests = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    sources.append(torch.randn(6, 4))
    dests.append(torch.zeros(4, 6, dtype=torch.bfloat16).t())
    return dests, sources


def check_pairs_copied_and_plan_replayed():
    module = importlib.import_module("arctic_rl_core.weight_sync.batched_copy")
    dests, sources = _pairs(0, module.CHUNK_WORDS)
    copy = module.BatchedCopy(dests, sources)
    assert copy.chunks is not None and len(copy.rest) >= 2, (copy.chunks, copy.rest)
    for _ in range(2):  # the second time with new values at the same addresses
        copy(dests, sources)
        for d, s in zip(dests, sources):
            assert torch.equal(d, s.to(d.dtype))
        for s in sources:
            s.mul_(-2)


CHECKS = {"pairs": (check_pairs_copied_and_plan_replayed, ())}


def test_pairs_are_copied_exactly_and_the_plan_is_replayed():
    assert run_interpreted(__file__)["pairs"] == "ok"


if __name__ == "__main__":
    report(CHECKS)
