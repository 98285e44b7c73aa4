"""Copy many tensors into many others at once: the receiving end of a weight sync.

A sync lands hundreds of tensors (290 for Qwen2-0.5B) in the sampler's
parameters. One ``copy_`` per tensor costs a launch and some Python each;
``torch._foreach_copy_`` batches them but runs at about 60% of the device's
copy bandwidth on these sizes. On CUDA, ``BatchedCopy`` moves every eligible
pair in one Triton launch instead: a table of 16-byte-aligned chunks, each
given as word offsets from two anchor tensors, copied as 16-byte vectors. Pairs
that do not qualify (different dtypes, unaligned, not contiguous) go through
``torch._foreach_copy_``.

The table holds addresses, not tensors: replay a plan only with the same
tensors (the native engine's ``WeightLoader`` checks that), and it never keeps
a sender's mapping alive.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

WORD_BYTES = 8  # the kernel moves int64 words ...
ALIGN_BYTES = 16  # ... two at a time: chunk starts and lengths are multiples of 16 bytes
CHUNK_WORDS = 4096  # 32 KB per program: long enough to stream, short enough to spread a tensor over the SMs
# Under Triton's interpreter (CPU tests) the kernel runs on host memory too.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_chunks(DST_ANCHOR, SRC_ANCHOR, CHUNKS, BLOCK: tl.constexpr):
        """One chunk: ``[dst_word, src_word, words]``, offsets from the anchors, all multiples of two words."""
        row = CHUNKS + tl.program_id(0) * 3
        dst = tl.multiple_of(tl.load(row), 2)
        src = tl.multiple_of(tl.load(row + 1), 2)
        words = tl.multiple_of(tl.load(row + 2), 2)
        offsets = tl.arange(0, BLOCK)
        mask = offsets < words
        tl.store(DST_ANCHOR + dst + offsets, tl.load(SRC_ANCHOR + src + offsets, mask=mask), mask=mask)

except ImportError:  # CPU-only installs: every copy takes the torch path
    triton = None


def _eligible(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        (dst.is_cuda or _INTERPRETED) and src.device == dst.device and dst.dtype == src.dtype and dst.shape == src.shape
        and dst.is_contiguous() and src.is_contiguous()
        and dst.data_ptr() % ALIGN_BYTES == 0 and src.data_ptr() % ALIGN_BYTES == 0
        and (dst.numel() * dst.element_size()) % ALIGN_BYTES == 0
    )  # fmt: skip


class BatchedCopy:
    """``dests[i].copy_(sources[i])`` for every i, planned once and replayed with one kernel launch."""

    def __init__(self, dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]):
        if len(dests) != len(sources):
            raise ValueError(f"BatchedCopy: {len(dests)} destinations for {len(sources)} sources")
        fast = [triton is not None and _eligible(d, s) for d, s in zip(dests, sources)]
        self.rest = [i for i, f in enumerate(fast) if not f]
        self.chunks = None
        if any(fast):
            device = dests[fast.index(True)].device
            # Anchors: 16-byte-aligned words that every address is counted from (one device, one address space).
            self.dst_anchor = torch.empty(2, dtype=torch.int64, device=device)
            self.src_anchor = torch.empty(2, dtype=torch.int64, device=device)
            rows = []
            for dst, src in (pair for pair, f in zip(zip(dests, sources), fast) if f):
                first_dst = (dst.data_ptr() - self.dst_anchor.data_ptr()) // WORD_BYTES
                first_src = (src.data_ptr() - self.src_anchor.data_ptr()) // WORD_BYTES
                words = dst.numel() * dst.element_size() // WORD_BYTES
                rows += [
                    (first_dst + w, first_src + w, min(CHUNK_WORDS, words - w)) for w in range(0, words, CHUNK_WORDS)
                ]
            self.chunks = torch.tensor(rows, dtype=torch.int64).to(device)

    def __call__(self, dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        if self.chunks is not None:
            _copy_chunks[(self.chunks.shape[0],)](self.dst_anchor, self.src_anchor, self.chunks, BLOCK=CHUNK_WORDS)
        if self.rest:
            torch._foreach_copy_([dests[i] for i in self.rest], [sources[i] for i in self.rest])
