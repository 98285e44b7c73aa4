"""On CUDA, log-probs and entropy go through the fused Triton kernels and agree with the torch path at a real vocab size."""

import pytest
import torch

from arctic_rl_core.processors import compute_entropy, compute_logprobs, compute_logprobs_and_entropy, post

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS, VOCAB = 2048, 151936  # Qwen2's vocabulary


def _logits(dtype, rows=ROWS, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (4 * torch.randn(rows, VOCAB, generator=g, device="cuda")).to(dtype)


def _torch_path(logits, labels, dtype):
    """The chunked torch path on the same CUDA logits, in ``dtype`` math: values, and logits to take gradients at."""
    logits = logits.detach().to(dtype).requires_grad_()
    logprobs, entropy = post._SoftmaxStatistics.apply(logits, labels, True, 512, False)
    return logprobs, entropy, logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_logprobs_entropy_and_gradients_equal_the_torch_path(dtype):
    logits = _logits(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    labels[:2] = torch.tensor([0, VOCAB - 1])
    weights = torch.randn(ROWS, device="cuda")
    assert post._fused(logits)
    logprobs, entropy = compute_logprobs_and_entropy(logits, labels)
    torch.testing.assert_close(compute_logprobs(logits, labels), logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compute_entropy(logits), entropy, rtol=1e-6, atol=1e-6)

    # The float32 torch path loses ~1e-5 of entropy to cancellation against a log-sum-exp of ~20 (the kernel
    # accumulates logits relative to the running max); float64 on the same logits is the exact reference.
    exact_logprobs, exact_entropy, exact_logits = _torch_path(logits, labels, torch.float64)
    f32_logprobs, f32_entropy, _ = _torch_path(logits, labels, torch.float32)
    for ours, exact, f32 in ((logprobs, exact_logprobs, f32_logprobs), (entropy, exact_entropy, f32_entropy)):
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, f32, rtol=1e-4, atol=1e-4)

    # gradients: the exact ones rounded once to the logits' dtype (one rounding step allowed at bf16/fp16)
    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    for ours, exact in (
        ((logprobs * weights).sum(), (exact_logprobs * weights).sum()),
        ((entropy * weights).sum(), (exact_entropy * weights).sum()),
        ((logprobs + entropy * weights).sum(), (exact_logprobs + exact_entropy * weights).sum()),
    ):
        (grad,) = torch.autograd.grad(ours, logits, retain_graph=True)
        (exact_grad,) = torch.autograd.grad(exact, exact_logits, retain_graph=True)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), exact_grad, **close)


def test_masked_logits_keep_entropy_finite_on_the_gpu():
    logits = _logits(torch.bfloat16, rows=64)
    logits[:, 1000:90000] = float("-inf")
    logits = logits.requires_grad_()
    labels = torch.randint(0, 1000, (64,), device="cuda")
    logprobs, entropy = compute_logprobs_and_entropy(logits, labels)
    exact_logprobs, exact_entropy, _ = _torch_path(logits, labels, torch.float64)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy.double(), exact_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs.double(), exact_logprobs, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad((logprobs + entropy).sum(), logits)
    assert torch.isfinite(grad).all() and (grad[:, 1000:90000] == 0).all()


def test_fused_path_keeps_no_float32_copy_of_the_logits():
    logits = _logits(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    size = logits.numel() * logits.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logprobs, entropy = compute_logprobs_and_entropy(logits, labels)
    (grad,) = torch.autograd.grad((logprobs + entropy).sum(), logits)
    # the bf16 gradient (one more logits-sized tensor) and per-row scalars; a float32 copy would be twice that
    assert torch.cuda.max_memory_allocated() - before < 1.1 * size


def test_float64_logits_on_cuda_keep_the_exact_torch_path():
    logits = _logits(torch.float64, rows=4)
    labels = torch.tensor([0, 5, VOCAB - 1, 7], device="cuda")
    assert not post._fused(logits)
    logprobs, entropy = compute_logprobs_and_entropy(logits, labels)
    log_softmax = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logprobs, log_softmax.gather(-1, labels[:, None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1))
