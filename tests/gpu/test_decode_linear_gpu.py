"""``decode_linear`` on CUDA: bf16 results as cuBLAS's within rounding, and a chain of programmatic-dependent
launches in a CUDA graph equal to the same kernels run one after another (so no launch reads early)."""

import pytest
import torch
import torch.nn.functional as F

from arctic_rl_core.engines.sampling.native import ops, triton_ops
from arctic_rl_core.engines.sampling.native.decode_linear import decode_linear
from arctic_rl_core.zorro.attention.triton_attention import supports_pdl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Qwen2-0.5B's projections: (output features, input features, gated).
QKV, O_PROJ, GATE_UP, DOWN = (1152, 896, False), (896, 896, False), (4864, 896, True), (896, 4864, False)


def _weight(n, k, gated, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(2 * n if gated else n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.03


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("shape", [QKV, O_PROJ, GATE_UP, DOWN], ids=["qkv", "o", "gate_up", "down"])
def test_bfloat16_results_match_cublas_within_rounding(rows, shape):
    n, k, gated = shape
    weight = _weight(n, k, gated, seed=rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = None if gated else torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ours = decode_linear(x, weight, bias, gated=gated)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if gated:
        exact = F.silu(exact[:, :n]) * exact[:, n:]
    cublas = ops.gated_linear(x, weight) if gated else F.linear(x, weight, bias)
    # Both round the same float32 sums to bf16 (ours in another order): errors of the same size.
    ours_error = (ours.double() - exact).abs().max().item()
    cublas_error = (cublas.double() - exact).abs().max().item()
    assert ours_error <= 2 * cublas_error + 1e-3


def _decoder(layers: int = 8):
    """Eight layers' projection weights (Qwen2-0.5B's shapes), one norm weight, and 16 rows of input."""
    weights = [[_weight(*shape, seed=4 * i + j) for j, shape in enumerate((QKV, O_PROJ, GATE_UP, DOWN))]
               for i in range(layers)]  # fmt: skip
    norm_weight = torch.rand(896, device="cuda", dtype=torch.bfloat16) + 0.5
    return weights, norm_weight, torch.randn(16, 896, device="cuda", dtype=torch.bfloat16)


def _assert_graph_replays_equal(chain, expected):
    """``chain(pdl=True)`` captured in a CUDA graph and replayed 20 times gives ``expected`` bit for bit."""
    torch.cuda.synchronize()
    chain(pdl=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(pdl=True)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_programmatic_dependent_chain_in_a_cuda_graph_equals_sequential_launches():
    if not supports_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    weights, norm_weight, x0 = _decoder()

    def chain(pdl):
        """A decoder's kernels: the norms between the projections, the residual stream through them."""
        x, residual = x0, None
        for qkv, o, gate_up, down in weights:
            h, residual = triton_ops.rms_norm(x, norm_weight, 1e-6, residual)
            h = decode_linear(decode_linear(h, qkv, pdl=pdl)[:, :896], o, pdl=pdl)
            h, residual = triton_ops.rms_norm(h, norm_weight, 1e-6, residual)
            x = decode_linear(decode_linear(h, gate_up, gated=True, pdl=pdl), down, pdl=pdl)
        return triton_ops.rms_norm(x, norm_weight, 1e-6, residual)[0]

    _assert_graph_replays_equal(chain, chain(pdl=False))


def test_norms_deferred_into_the_projections_equal_the_unfused_chain_within_rounding():
    """A decoder's chain with each norm carried by the projections around it (``ops.linear_into_residual``):
    within bf16 noise of the chain with norm kernels, and in a CUDA graph of programmatic-dependent launches
    equal to the same kernels launched one after another, bit for bit."""
    weights, norm_weight, x0 = _decoder()

    def unfused(dtype, device):
        """The layers' ops one by one: float64 on the CPU is the exact reference, bf16 on CUDA its rounding."""
        x, residual, w = x0.to(device, dtype), None, norm_weight.to(device, dtype)
        for layer in weights:
            qkv, o, gate_up, down = (p.to(device, dtype) for p in layer)
            h, residual = ops.rms_norm(x, w, 1e-6, residual)
            h, residual = ops.rms_norm(F.linear(F.linear(h, qkv)[:, :896], o), w, 1e-6, residual)
            x = F.linear(ops.silu_and_mul(F.linear(h, gate_up)), down)
        return ops.rms_norm(x, w, 1e-6, residual)[0].to("cuda")

    def project(h, weight, pdl, **options):
        if isinstance(h, ops.DeferredNorm):
            return decode_linear(h.scaled, weight, pdl=pdl, row_norm=(h.sum_squares, h.eps), **options)
        return decode_linear(h, weight, pdl=pdl, **options)

    def fused(pdl):
        h, residual = triton_ops.rms_norm(x0, norm_weight, 1e-6, None)
        for qkv, o, gate_up, down in weights:
            q = project(h, qkv, pdl)[:, :896].contiguous()
            h = ops.DeferredNorm(*project(q, o, pdl, into_residual=(residual, norm_weight)), 1e-6)
            g = project(h, gate_up, pdl, gated=True)
            h = ops.DeferredNorm(*project(g, down, pdl, into_residual=(residual, norm_weight)), 1e-6)
        return ops.apply_norm(h)

    exact, rounded = unfused(torch.float64, "cpu"), unfused(torch.bfloat16, "cuda")
    expected = fused(pdl=False)
    assert (expected.double() - exact).abs().max() <= 2 * (rounded.double() - exact).abs().max() + 1e-2
    if supports_pdl(torch.device("cuda")):
        _assert_graph_replays_equal(fused, expected)
