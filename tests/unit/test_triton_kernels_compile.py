"""The attention and sampling kernels compile to Hopper machine code (sm_90a) here, with no GPU.

The interpreter tests (``test_fca_triton.py``, ``test_native_triton_ops.py``)
check what the kernels compute; they never reach Triton's compiler, which is
where a construct the GPU path cannot lower fails. Triton compiles for a named
target without a device, through its bundled ``ptxas``, so a kernel (or an
attention variant) that would not build on the GPU machine fails here first.
"""

import collections
import dataclasses
import re

import pytest
import torch

pytest.importorskip("triton")
from arctic_rl_core.engines.sampling.native import triton_ops  # noqa: E402
from arctic_rl_core.triton_aot import compile_for, loop_opcodes, register_use  # noqa: E402
from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.plan import ROWS_128, TileShape  # noqa: E402

DEFAULT = TileShape(7)  # Qwen2-0.5B: 14 query heads over 2 KV heads
VARIANTS = {
    "default": DEFAULT,
    "late_loads": dataclasses.replace(DEFAULT, early_loads=False),
    "rows128": dataclasses.replace(DEFAULT, **ROWS_128),
    "wide_stages=3": dataclasses.replace(DEFAULT, wide_stages=3),
    "int64_offsets": dataclasses.replace(DEFAULT, int32_offsets=False),
}


def _pointers(types: dict[str, str]) -> list[str]:
    """The pointer arguments among ``compile_for``'s ``types``: the JIT takes them as 16-byte aligned (whole
    allocations), and so must a static build that is to match the device's."""
    return [name for name, kind in types.items() if kind.startswith("*")]


def _compile_attention(tiles: TileShape, wide: bool):
    """What ``paged_attention`` launches for a bf16 Qwen2-0.5B layer (14 heads, 2 KV heads, 64 dims, 16 per block)."""
    return kernel.compile_attention(tiles, 14, 2, 64, 16, torch.bfloat16, wide)


@pytest.mark.parametrize("name", VARIANTS)
def test_attention_kernel_compiles_for_hopper(name):
    compiled = _compile_attention(VARIANTS[name], wide=True)
    assert len(compiled.asm["cubin"]) > 0
    # Launched as a programmatic dependent: it must wait for the kernel that wrote its queries.
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]


def test_plain_decode_kernel_compiles_for_hopper():
    compiled = _compile_attention(DEFAULT, wide=False)
    assert len(compiled.asm["cubin"]) > 0


def test_register_use_reads_ptxas_and_respects_the_cap():
    rows128 = VARIANTS["rows128"]
    capped = register_use(_compile_attention(rows128, wide=True))
    uncapped = register_use(_compile_attention(dataclasses.replace(rows128, wide_maxnreg=None), wide=True))
    assert 0 < capped.registers <= rows128.wide_maxnreg < uncapped.registers <= 255
    # The cap is what lets two 8-warp programs share a multiprocessor; without it only one fits.
    assert kernel.programs_per_sm(capped.registers, 8, 0) == 2
    assert kernel.programs_per_sm(uncapped.registers, 8, 0) == 1


def _steps_issued_before_the_wide_loop(tiles: TileShape) -> float:
    """How many steps' keys and values Triton's pipeline copies before the wide tiles' step loop starts (their copies
    into shared memory, up to the first loop that carries values: the wide tiles' steps)."""
    ttgir = _compile_attention(tiles, wide=True).asm["ttgir"]
    before_loop = ttgir[: re.search(r"scf\.for .* iter_args", ttgir).start()]
    return len(re.findall(rf"async_copy_global_to_local .* -> <{tiles.block_n}x64xbf16", before_loop)) / 2


def test_wide_step_loop_keeps_two_steps_of_keys_in_flight():
    """Each step's block ids take a pipeline stage ahead of its keys and values, so below five stages Triton copies a
    step's keys at the end of the step before, with nothing to hide their latency behind; from five on, two steps
    ahead (the default)."""
    assert _steps_issued_before_the_wide_loop(dataclasses.replace(DEFAULT, wide_stages=4)) == 1
    assert _steps_issued_before_the_wide_loop(DEFAULT) == 2


def test_32_bit_offsets_take_fewer_instructions_per_step():
    """A whole wide step (no mask to apply) with 32-bit cache offsets, against 64-bit ones: 346 vs 379 instructions
    with the device's Triton 3.6, 365 vs 398 with 3.9; the same products and asynchronous copies."""

    def whole_step(tiles):
        return collections.Counter(loop_opcodes(_compile_attention(tiles, wide=True), "tnspB", branches_taken=True))

    int32 = whole_step(DEFAULT)
    int64 = whole_step(dataclasses.replace(DEFAULT, int32_offsets=False))
    assert int32["HGMMA"] == int64["HGMMA"] == 8  # one 64-key step: QK and PV, four k-slices each
    assert int32["LDGSTS"] == int64["LDGSTS"] > 0
    assert sum(int32.values()) <= sum(int64.values()) - 20


def test_compile_for_names_unknown_arguments():
    with pytest.raises(ValueError, match="NOT_AN_ARGUMENT"):
        compile_for(kernel._merge_partials, {"NOT_AN_ARGUMENT": "*fp32"}, {})


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_sampling_kernels_compile_for_hopper(processed):
    rows = {
        "TEMPERATURE": "*fp32",
        "PART_MAX": "*fp32",
        "PART_SUM": "*fp32",
        "PART_BEST": "*fp32",
        "PART_INDEX": "*i32",
    }
    split_types = {**rows, "LOGITS": "*fp32", "MIN_LOGIT": "*fp32", "NOISE_KEYS": "*i64", "FIRST_STEPS": "*i64",
                   "BANNED": "*i32", "MIN_TOKENS": "*i64"}  # fmt: skip
    # As the JIT specializes a Qwen2 vocabulary (151936, a multiple of 16) over whole allocations.
    split = compile_for(
        triton_ops._sample_split_kernel, split_types,
        dict(NUM_BANNED=3, SPLIT=triton_ops.SAMPLE_SPLIT, BLOCK=1024, PROCESSED=processed),
        _pointers(split_types) + ["stride_l", "vocab"], num_warps=4,
    )  # fmt: skip
    combine_types = {**rows, "LOGITS": "*fp32", "TOKENS": "*i64", "LOGPROBS": "*fp32"}
    combine = compile_for(
        triton_ops._sample_combine_kernel, combine_types, dict(SPLITS_PAD=64, PROCESSED=processed),
        _pointers(combine_types), num_warps=1,
    )  # fmt: skip
    assert len(split.asm["cubin"]) > 0 and len(combine.asm["cubin"]) > 0
    assert register_use(split).spill_stores == 0 and register_use(combine).spill_stores == 0


@pytest.mark.parametrize("head_dim, qk_norm", [(64, False), (128, True)])
def test_rotary_kernel_compiles_for_hopper(head_dim, qk_norm):
    """The standalone rotary and cache write (prefill, and decode of heads too wide for the epilogue)."""
    types = dict.fromkeys(("QKV", "Q_NORM", "K_NORM", "Q_OUT", "K_CACHE", "V_CACHE"), "*bf16") | {
        "POS": "*i32", "COS": "*fp32", "SIN": "*fp32", "SLOTS": "*i64", "eps": "fp32"
    }  # fmt: skip
    # As the JIT specializes a launch over whole allocations: every stride a multiple of 16 (heads of 64 or 128).
    strides = ["stride_qkv", "stride_qt", "stride_qh", "stride_cos", "stride_ks", "stride_kh"]
    compiled = compile_for(
        triton_ops._rotary_store_kernel, types,
        dict(NUM_HEADS=28, NUM_KV_HEADS=4, HEAD_DIM=head_dim, HAS_NORM=qk_norm, BLOCK_M=triton_ops.ROTARY_TOKENS,
             USE_PDL=True),
        _pointers(types) + strides, num_warps=2,
    )  # fmt: skip
    assert register_use(compiled).spill_stores == 0


DECODE_LINEAR_BASE = dict(
    HAS_BIAS=False, GATED=False, SPLIT_K=1, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PRECISION="tf32", USE_PDL=True,
    SCALE_ROWS=False, PARTS=1, INTO_RESIDUAL=False, ROTARY=False, NUM_HEADS=0, NUM_KV_HEADS=0, QK_NORM=False,
)  # fmt: skip
# What a Qwen2-0.5B decode layer launches at 16 rows, and a q/k/v projection of 32-dim heads split in two.
DECODE_LINEAR_CASES = {
    "qkv_rotary_from_deferred_norm": dict(
        HAS_BIAS=True, SCALE_ROWS=True, PARTS=16, ROTARY=True, NUM_HEADS=14, NUM_KV_HEADS=2
    ),  # fmt: skip
    "qkv_rotary_qk_norm": dict(SCALE_ROWS=True, PARTS=16, ROTARY=True, NUM_HEADS=14, NUM_KV_HEADS=2, QK_NORM=True),
    "o_into_residual": dict(INTO_RESIDUAL=True),
    "gate_up_from_deferred_norm": dict(GATED=True, SCALE_ROWS=True, PARTS=16),
    "down_split_k_into_residual": dict(SPLIT_K=8, INTO_RESIDUAL=True),
    "qkv_rotary_32_split_k": dict(BLOCK_N=32, SPLIT_K=2, ROTARY=True, NUM_HEADS=28, NUM_KV_HEADS=4),
}


@pytest.mark.parametrize("case", DECODE_LINEAR_CASES)
def test_decode_linear_epilogues_compile_for_hopper_with_a_pipelined_k_loop(case):
    """The norm and rotary epilogues (tile reshapes, splits, the in-place residual) lower for sm_90a, and the K
    loop is one software pipeline: its loads are asynchronous copies into buffers of ``stage_bytes`` each (gate
    and up in the same steps), ``stages`` of them at most, as ``pick_tiles`` budgets them."""
    from arctic_rl_core.engines.sampling.native.decode_linear import _decode_linear_kernel, stage_bytes

    types = {name: "*bf16" for name in ("X", "W", "BIAS", "Y", "RESIDUAL", "NORM_WEIGHT", "Q_NORM", "K_NORM",
                                        "K_CACHE", "V_CACHE")}  # fmt: skip
    types |= {name: "*fp32" for name in ("PARTIAL", "SUM_SQUARES", "SUM_SQUARES_OUT", "COS", "SIN")}
    types |= {"COUNTERS": "*i32", "POS": "*i64", "SLOTS": "*i64", "eps": "fp32", "qk_eps": "fp32"}
    # As Triton's JIT specializes a 16-row launch of these shapes: every pointer, size and stride a multiple of 16.
    # Without that the loads are not vectorized, and the loop is not pipelined.
    sizes = ("rows", "n", "k_per_split", "K", "prefetch_k", "stride_x", "stride_w", "stride_y", "stride_r")
    aligned = _pointers(types) + list(sizes)
    constants = {**DECODE_LINEAR_BASE, **DECODE_LINEAR_CASES[case]}
    stages = 4
    compiled = compile_for(_decode_linear_kernel, types, constants, aligned, num_warps=4, num_stages=stages)
    assert len(compiled.asm["cubin"]) > 0
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
    assert "async_copy_global_to_local" in compiled.asm["ttgir"]
    per_stage = stage_bytes(constants["BLOCK_M"], constants["BLOCK_N"], constants["BLOCK_K"], constants["GATED"])
    # stages - 1 buffers in flight (Triton may keep one more for the epilogue): within what pick_tiles budgets.
    assert (stages - 1) * per_stage <= compiled.metadata.shared <= stages * per_stage
