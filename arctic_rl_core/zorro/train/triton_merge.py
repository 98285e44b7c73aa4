"""One Triton kernel for the split's log-sum-exp merge: a span's partial attention folded into the running one.

In torch the merge is a dozen element-wise kernels (casts, exps, two products,
a sum, the new lse, copies back), each a launch over the span's rows. Here each
program reads a block of rows of one head once and writes the merged output and
log-sum-exp in place, in float32 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32


@triton.jit
def _merge_kernel(
    out_ptr, lse_ptr, part_ptr, part_lse_ptr, rows,
    out_row, out_head, lse_head, lse_row, part_row, part_head, part_lse_head, part_lse_row,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(1)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_D)
    live = row < rows
    cell = live[:, None] & (col[None, :] < HEAD_DIM)

    lse = tl.load(lse_ptr + head * lse_head + row * lse_row, mask=live, other=0.0)
    part_lse = tl.load(part_lse_ptr + head * part_lse_head + row * part_lse_row, mask=live, other=0.0)
    top = tl.maximum(lse, part_lse)
    keep, add = tl.exp(lse - top), tl.exp(part_lse - top)
    total = keep + add

    out_at = out_ptr + row[:, None] * out_row + head * out_head + col[None, :]
    out = tl.load(out_at, mask=cell, other=0.0).to(tl.float32)
    part = tl.load(part_ptr + row[:, None] * part_row + head * part_head + col[None, :], mask=cell, other=0.0)
    merged = (out * keep[:, None] + part.to(tl.float32) * add[:, None]) / total[:, None]
    tl.store(out_at, merged.to(out_ptr.dtype.element_ty), mask=cell)
    tl.store(lse_ptr + head * lse_head + row * lse_row, top + tl.log(total), mask=live)


def merge_attention_(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """``out`` [n, H, D] and ``lse`` [H, n] (float32) become the merge of themselves and ``part``/``part_lse``.

    Any row and head strides; the head dimension must be contiguous. Both lse must be finite
    (every query sees at least one key in each part).
    """
    rows, heads, head_dim = out.shape
    if part.shape != out.shape or lse.shape != (heads, rows) or part_lse.shape != lse.shape:
        raise ValueError(
            f"merge: out {tuple(out.shape)}, part {tuple(part.shape)}, lse {tuple(lse.shape)} and "
            f"part_lse {tuple(part_lse.shape)} must be [n, H, D], [n, H, D], [H, n], [H, n]"
        )
    if out.stride(2) != 1 or part.stride(2) != 1 or lse.dtype != torch.float32 or part_lse.dtype != torch.float32:
        raise ValueError("merge: out and part need a contiguous head dimension, and both lse float32")
    grid = (triton.cdiv(rows, BLOCK_ROWS), heads)
    _merge_kernel[grid](
        out, lse, part, part_lse, rows,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        part.stride(0), part.stride(1), part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_ROWS=BLOCK_ROWS,
    )  # fmt: skip
