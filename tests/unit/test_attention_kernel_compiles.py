"""The fused attention kernel compiles to Hopper machine code (sm_90a) here, with no GPU, in each of its variants.

The interpreter tests (``test_fca_triton.py``) check what the kernel computes;
they never reach Triton's compiler, which is where a construct the GPU path
cannot lower fails. Triton compiles for a named target without a device,
through its bundled ``ptxas``, so a variant that would not build on the GPU
machine fails here first.
"""

import dataclasses

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = {
    "Q": "*bf16", "K_CACHE": "*bf16", "V_CACHE": "*bf16", "OUT": "*bf16", "PART_O": "*bf16", "PART_LSE": "*fp32",
    "BLOCK_TABLES": "*i32", "WIDE_ITEMS": "*i32", "NARROW_ITEMS": "*i32", "COUNTS": "*i32", "QUERY_INDEX": "*i32",
    "QUERY_POS": "*i32", "scale_log2": "fp32",
}  # fmt: skip
DEFAULT = TileShape(7)  # Qwen2-0.5B: 14 query heads over 2 KV heads
VARIANTS = {
    "default": DEFAULT,
    "early_loads": dataclasses.replace(DEFAULT, early_loads=True),
    "narrow_prefetch": dataclasses.replace(DEFAULT, narrow_prefetch=True),
    "wide_stages": dataclasses.replace(DEFAULT, wide_stages=3),
}


def _compile(tiles: TileShape, wide: bool, decode: bool):
    """``paged_attention``'s launch options for a bf16 Qwen2-0.5B layer, compiled for an H100/H200."""
    constants = dict(
        NUM_HEADS=14, NUM_KV_HEADS=2, GROUP=tiles.group, HEAD_DIM=64, BLOCK_SIZE=16, WIDE_M=tiles.wide_rows,
        NARROW_M=tiles.narrow_rows, BLOCK_N=tiles.block_n, HAS_WIDE=wide, PRECISION="tf32", USE_PDL=True,
        EARLY=tiles.early_loads, DECODE=decode, NARROW_PREFETCH=tiles.narrow_prefetch, NARROW_STAGES=tiles.stages,
        WIDE_STAGES=tiles.wide_stages,
    )  # fmt: skip
    names = kernel._attend_items.arg_names
    assert set(constants) | set(POINTERS) <= set(names), "the kernel's arguments changed: update this test"
    signature = {n: "constexpr" if n in constants else POINTERS.get(n, "i32") for n in names}
    source = ASTSource(kernel._attend_items, signature, {(names.index(n),): v for n, v in constants.items()})
    options = {"num_warps": tiles.wide_warps if wide else 4, "num_stages": tiles.stages}
    if wide and tiles.wide_maxnreg:
        options["maxnreg"] = tiles.wide_maxnreg
    return triton.compile(source, target=HOPPER, options=options)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_attention_kernel_compiles_for_hopper(name, decode):
    compiled = _compile(VARIANTS[name], wide=True, decode=decode)
    assert len(compiled.asm["cubin"]) > 0
    # Launched as a programmatic dependent: it must wait for the kernel that wrote its queries.
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]


def test_plain_decode_kernel_compiles_for_hopper():
    compiled = _compile(DEFAULT, wide=False, decode=True)
    assert len(compiled.asm["cubin"]) > 0
