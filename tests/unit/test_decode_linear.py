"""``decode_linear``, run by Triton's interpreter on CPU, equals ``F.linear`` (and ``silu(gate) * up`` of it).

The kernel checks run in a fresh Python with ``TRITON_INTERPRET=1``
(``tests.triton_interpreter``); each test reads its result. The tile policy
is plain Python and is tested here directly.
"""

import importlib
import threading

import pytest
import torch
import torch.nn.functional as F

from arctic_rl_core.engines.sampling.native import ops
from arctic_rl_core.engines.sampling.native.decode_linear import (
    MAX_ROWS,
    MAX_STAGES,
    LinearTiles,
    pick_tiles,
    stage_bytes,
)
from tests.triton_interpreter import check_test, report


def _module():
    return importlib.import_module("arctic_rl_core.engines.sampling.native.decode_linear")


def _expected(x, weight, bias, gated):
    out = F.linear(x, weight, bias)
    return ops.silu_and_mul(out) if gated else out


def check_equals_f_linear(gated: bool, split_k: int, with_bias: bool):
    decode_linear = _module().decode_linear
    g = torch.Generator().manual_seed(split_k + 2 * gated)
    n, k = 48, 512
    weight = torch.randn(2 * n if gated else n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    tiles = LinearTiles(block_n=16, block_k=128, split_k=split_k)
    for rows in (1, 5, 16, 33):
        x = torch.randn(rows, k, generator=g)
        # Twice: a split-K launch must leave its arrival counters ready for the next one.
        for _ in range(2):
            actual = decode_linear(x, weight, bias, gated=gated, tiles=tiles)
            torch.testing.assert_close(actual, _expected(x, weight, bias, gated), rtol=1e-4, atol=1e-4)


def check_split_k_with_uneven_slices_and_ragged_output_tiles():
    """K of 5 steps in 2 slices (3 + 2) and n = 40 over tiles of 16 (the last tile partly outside)."""
    decode_linear = _module().decode_linear
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(3, 320, generator=g), torch.randn(40, 320, generator=g)
    actual = decode_linear(x, weight, tiles=LinearTiles(block_n=16, block_k=64, split_k=2))
    torch.testing.assert_close(actual, F.linear(x, weight), rtol=1e-4, atol=1e-4)


def check_a_norm_between_projections_needs_no_kernel_of_its_own(split_k: int, gated: bool):
    """``into_residual`` then ``row_norm``: the second projection of ``rms_norm(residual + first projection)``."""
    module = _module()
    g = torch.Generator().manual_seed(11 + split_k + 2 * gated)
    hidden, k, n, eps = 192, 256, 48, 1e-6  # 192 columns over 16-wide tiles: 12 parts, padded to 16 by the reader
    first, bias = torch.randn(hidden, k, generator=g) * 0.1, torch.randn(hidden, generator=g)
    second = torch.randn(2 * n if gated else n, hidden, generator=g)
    second_bias = None if gated else torch.randn(n, generator=g)
    norm_weight = torch.rand(hidden, generator=g) + 0.5
    tiles = LinearTiles(block_n=16, block_k=64, split_k=split_k)
    for rows in (1, 5, 16):
        x, residual = torch.randn(rows, k, generator=g), torch.randn(rows, hidden, generator=g)
        normed, stream = ops.rms_norm(F.linear(x, first, bias), norm_weight, eps, residual.clone())
        scaled, sum_squares = module.decode_linear(x, first, bias, tiles=tiles, into_residual=(residual, norm_weight))
        torch.testing.assert_close(residual, stream, rtol=1e-5, atol=1e-5)  # updated in place
        deferred = ops.DeferredNorm(scaled, sum_squares, eps)
        torch.testing.assert_close(ops.apply_norm(deferred), normed, rtol=1e-4, atol=1e-4)
        actual = module.decode_linear(scaled, second, second_bias, gated=gated, tiles=tiles,
                                      row_norm=(sum_squares, eps))  # fmt: skip
        expected = _expected(normed, second, second_bias, gated)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def check_the_scale_rows_kernel_equals_apply_norm_in_torch():
    kernels = importlib.import_module("arctic_rl_core.engines.sampling.native.triton_ops")
    g = torch.Generator().manual_seed(5)
    scaled, sum_squares = torch.randn(5, 80, generator=g), torch.rand(5, 16, generator=g) * 80
    expected = ops.apply_norm(ops.DeferredNorm(scaled, sum_squares, 1e-6))
    torch.testing.assert_close(kernels.scale_rows(scaled, sum_squares, 1e-6), expected, rtol=1e-6, atol=1e-6)


def check_rotary_finishes_a_qkv_projection_as_rotary_and_store(qk_norm: bool, split_k: int):
    """``rotary``: the queries, and the keys and values in their cache slots, as ``ops.rotary_and_store`` leaves
    them after ``F.linear`` (a negative slot, graph padding, is not written)."""
    module = _module()
    g = torch.Generator().manual_seed(21 + qk_norm + split_k)
    heads, kv_heads, dim, k = 4, 2, 16, 128
    weight = torch.randn((heads + 2 * kv_heads) * dim, k, generator=g) * 0.1
    bias = torch.randn(weight.shape[0], generator=g)
    x = torch.randn(5, k, generator=g)
    positions, slots = torch.tensor([0, 3, 5, 7, 2]), torch.tensor([3, -1, 7, 8, 15])
    freqs = torch.arange(16).float()[:, None] / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    norms = (torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5) if qk_norm else (None, None)
    caches = [torch.zeros(4, 4, kv_heads, dim) for _ in range(4)]
    expected = ops.rotary_and_store(F.linear(x, weight, bias), positions, freqs.cos(), freqs.sin(), *norms, 1e-6,
                                    caches[0], caches[1], slots, heads, kv_heads)  # fmt: skip
    store = ops.RotaryStore(positions, freqs.cos(), freqs.sin(), *norms, 1e-6, caches[2], caches[3], slots, heads,
                               kv_heads)  # fmt: skip
    tiles = LinearTiles(block_n=dim, block_k=64, split_k=split_k)
    actual = module.decode_linear(x, weight, bias, tiles=tiles, rotary=store)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[2], caches[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[3], caches[1], rtol=1e-4, atol=1e-4)
    assert caches[2].flatten(0, 1)[[0, 1, 2, 4]].abs().sum() == 0  # only slots 3, 7, 8 and 15 are written


CHECKS = {
    "plain": (check_equals_f_linear, (False, 1, False)),
    "bias": (check_equals_f_linear, (False, 1, True)),
    "split_k": (check_equals_f_linear, (False, 4, True)),
    "gated": (check_equals_f_linear, (True, 1, False)),
    "gated_split_k": (check_equals_f_linear, (True, 2, False)),
    "uneven_split": (check_split_k_with_uneven_slices_and_ragged_output_tiles, ()),
    "norm_between": (check_a_norm_between_projections_needs_no_kernel_of_its_own, (1, False)),
    "norm_between_split_k": (check_a_norm_between_projections_needs_no_kernel_of_its_own, (2, False)),
    "norm_between_gated": (check_a_norm_between_projections_needs_no_kernel_of_its_own, (2, True)),
    "scale_rows": (check_the_scale_rows_kernel_equals_apply_norm_in_torch, ()),
    "rotary": (check_rotary_finishes_a_qkv_projection_as_rotary_and_store, (False, 1)),
    "rotary_qk_norm_split_k": (check_rotary_finishes_a_qkv_projection_as_rotary_and_store, (True, 2)),
}


test_kernel_under_the_interpreter = check_test(__file__, CHECKS)


def test_tiles_split_a_long_k_until_the_grid_fills_the_device():
    # Qwen2-0.5B's down projection at 16 rows: 14 output tiles, 38 steps of K.
    down = pick_tiles(16, 896, 4864, num_sms=132)
    assert (down.block_n, down.split_k) == (64, 8)
    # Its gate/up projection already spans 76 tiles of 7 steps: splitting would leave slices of one step.
    assert pick_tiles(16, 4864, 896, num_sms=132, gated=True).split_k == 1


def test_tiles_keep_the_pipeline_within_shared_memory():
    for rows in (1, 16, 64):
        for gated in (False, True):
            tiles = pick_tiles(rows, 4864, 896, num_sms=132, gated=gated)
            stage = ((2 if gated else 1) * tiles.block_n + max(16, rows)) * tiles.block_k * 2
            assert stage == stage_bytes(rows, tiles.block_n, tiles.block_k, gated)
            assert 1 <= tiles.stages <= MAX_STAGES and tiles.stages * stage <= 200 << 10


def test_the_pipeline_puts_a_short_slice_wholly_in_flight_and_no_deeper():
    # Qwen2-0.5B at 16 rows: q/k/v's 7 steps of K take 6 stages (the most), the down projection's slices of
    # 5 steps take 6 (all in flight), gate/up's two weight tiles per step fit 5.
    assert pick_tiles(16, 1152, 896, num_sms=132, block_n=64).stages == MAX_STAGES == 6
    down = pick_tiles(16, 896, 4864, num_sms=132)
    assert down.launch(896, 4864)[2] // down.block_k + 1 == down.stages == 6
    assert pick_tiles(16, 4864, 896, num_sms=132, gated=True).stages == 5
    # A K of two steps needs three stages, not six.
    assert pick_tiles(16, 896, 256, num_sms=132).stages == 3


def test_shapes_the_kernel_does_not_take_are_left_to_cublas():
    assert pick_tiles(MAX_ROWS + 1, 896, 896, num_sms=132) is None  # a prefill-sized batch
    assert pick_tiles(16, 896, 900, num_sms=132) is None  # K not a multiple of 64
    assert pick_tiles(16, 900, 896, num_sms=132) is None  # n not a multiple of 16
    # Past 16 rows, large weights (Qwen2.5-7B's gate/up, 271 MB) go to cuBLAS, small ones (Qwen2-0.5B's) do not.
    assert pick_tiles(64, 18944, 3584, num_sms=132, gated=True) is None
    assert pick_tiles(16, 18944, 3584, num_sms=132, gated=True) is not None
    assert pick_tiles(64, 4864, 896, num_sms=132, gated=True) is not None
    with pytest.raises(ValueError, match="no tiles for 65 rows"):
        _module().decode_linear(torch.zeros(65, 896), torch.zeros(896, 896))


def test_fused_epilogues_name_what_they_need_of_their_inputs():
    """Checked before any launch: each error names the argument and what was expected."""
    decode_linear = _module().decode_linear
    x, weight, tiles = torch.zeros(4, 128), torch.zeros(96, 128), LinearTiles(block_n=16, block_k=64, split_k=1)
    with pytest.raises(ValueError, match=r"into_residual: expected a residual of \(4, 96\)"):
        decode_linear(x, weight, tiles=tiles, into_residual=(torch.zeros(4, 64), torch.zeros(96)))
    with pytest.raises(ValueError, match="into_residual needs a plain projection"):
        decode_linear(x, weight, gated=True, tiles=tiles, into_residual=(torch.zeros(4, 48), torch.zeros(48)))
    with pytest.raises(ValueError, match="row_norm: sum_squares has rows of 8; expected 16"):
        decode_linear(x, weight, tiles=tiles, row_norm=(torch.zeros(6, 8), 1e-6))
    caches = torch.zeros(4, 4, 2, 16)
    store = ops.RotaryStore(torch.zeros(4, dtype=torch.int64), torch.zeros(8, 8), torch.zeros(8, 8), None, None,
                            1e-6, caches, caches, torch.zeros(4, dtype=torch.int64), 2, 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"rotary: expected a plain q/k/v projection of 96 outputs"):
        decode_linear(x, torch.zeros(80, 128), tiles=tiles, rotary=store)
    with pytest.raises(ValueError, match=r"in tiles of one head \(16\); got 96 outputs in tiles of 32"):
        decode_linear(x, weight, tiles=LinearTiles(block_n=32, block_k=64, split_k=1), rotary=store)
    with pytest.raises(ValueError, match="does not combine with gated or into_residual"):
        decode_linear(x, weight, tiles=tiles, rotary=store, into_residual=(torch.zeros(4, 96), torch.zeros(96)))


def test_split_k_counters_are_one_set_per_thread_and_never_replaced():
    """Engines on two threads must not share arrival counters; graphs keep the address of theirs."""
    module = _module()
    cpu = torch.device("cpu")
    mine = module._counters(cpu, 8)
    assert module._counters(cpu, module.COUNTER_CAPACITY) is mine
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(module._counters(cpu, 8)))
    worker.start()
    worker.join()
    assert theirs[0] is not mine and theirs[0].data_ptr() != mine.data_ptr()
    with pytest.raises(ValueError, match="output tiles in one split-K launch"):
        module._counters(cpu, module.COUNTER_CAPACITY + 1)


def test_cpu_and_float32_calls_go_to_torch():
    """``ops.linear`` only takes the kernel for half-precision CUDA batches; elsewhere it is ``F.linear`` exactly."""
    g = torch.Generator().manual_seed(3)
    x, weight, bias = torch.randn(4, 128, generator=g), torch.randn(64, 128, generator=g), torch.randn(64, generator=g)
    assert torch.equal(ops.linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(ops.gated_linear(x, weight), ops.silu_and_mul(F.linear(x, weight)))
    # A block's last projection: the residual add and the norm after it, as the unfused layers compute them.
    residual, norm_weight = torch.randn(4, 64, generator=g), torch.rand(64, generator=g)
    expected = ops.rms_norm(F.linear(x, weight, bias), norm_weight, 1e-6, residual)
    actual = ops.linear_into_residual(x, weight, bias, residual, norm_weight, 1e-6)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


if __name__ == "__main__":
    report(CHECKS)
