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


def test_programmatic_dependent_chain_in_a_cuda_graph_equals_sequential_launches():
    if not supports_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layers = 8
    weights = [[_weight(*shape, seed=4 * i + j) for j, shape in enumerate((QKV, O_PROJ, GATE_UP, DOWN))]
               for i in range(layers)]  # fmt: skip
    norm_weight = torch.rand(896, device="cuda", dtype=torch.bfloat16) + 0.5
    x0 = torch.randn(16, 896, device="cuda", dtype=torch.bfloat16)

    def chain(pdl):
        """A decoder's kernels: the norms between the projections, the residual stream through them."""
        x, residual = x0, None
        for qkv, o, gate_up, down in weights:
            h, residual = triton_ops.rms_norm(x, norm_weight, 1e-6, residual)
            h = decode_linear(decode_linear(h, qkv, pdl=pdl)[:, :896], o, pdl=pdl)
            h, residual = triton_ops.rms_norm(h, norm_weight, 1e-6, residual)
            x = decode_linear(decode_linear(h, gate_up, gated=True, pdl=pdl), down, pdl=pdl)
        return triton_ops.rms_norm(x, norm_weight, 1e-6, residual)[0]

    expected = chain(pdl=False)
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
