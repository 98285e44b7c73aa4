"""Post-processors: temperature, chunked log-probs and entropy, and the ``processing["post"]`` pipeline.

The fused Triton kernels (CUDA's path for bf16/fp16/fp32) are checked against
the torch path on CPU by Triton's interpreter: those checks run in a fresh
Python with ``TRITON_INTERPRET=1`` (``tests.triton_interpreter``).
"""

import math
import warnings

import pytest
import torch

from arctic_rl_core.processors import (
    PostProcessingError,
    apply_temperature,
    compute_entropy,
    compute_logprobs,
    compute_logprobs_and_entropy,
    post,
    resolve_post,
)
from tests.triton_interpreter import check_test, report

# softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]
ROW = [0.0, math.log(2.0), math.log(3.0)]


def test_apply_temperature_divides_logits():
    logits = torch.tensor([[2.0, 4.0, -6.0]])
    assert torch.equal(apply_temperature(logits, 2.0), torch.tensor([[1.0, 2.0, -3.0]]))


def test_temperature_one_returns_the_same_tensor():
    logits = torch.randn(2, 5)
    assert apply_temperature(logits, 1.0) is logits


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_apply_temperature_rejects_non_positive_or_non_finite(bad):
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(torch.zeros(1, 2), bad)


def test_compute_logprobs_matches_hand_computed_values_and_gradient():
    logits = torch.tensor([ROW, ROW], requires_grad=True)
    logprobs = compute_logprobs(logits, torch.tensor([2, 0]))
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, torch.tensor([math.log(0.5), math.log(1 / 6)]))
    logprobs[0].backward()
    # d log p_2 / d logits = onehot(2) - p
    torch.testing.assert_close(logits.grad, torch.tensor([[-1 / 6, -2 / 6, 3 / 6], [0.0, 0.0, 0.0]]))


def test_compute_entropy_matches_hand_computed_values_and_gradient():
    logits = torch.tensor([ROW, [0.5, 0.5, 0.5]], requires_grad=True)
    entropy = compute_entropy(logits)
    # H = (1/6) ln 6 + (1/3) ln 3 + (1/2) ln 2 = 1.011404; a uniform row over 3 has ln 3
    torch.testing.assert_close(entropy, torch.tensor([1.011404, math.log(3.0)]))
    entropy[0].backward()
    # dH/dx_j = -p_j (ln p_j + H)
    torch.testing.assert_close(logits.grad[0], torch.tensor([0.130059, 0.029069, -0.159128]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad[1], torch.zeros(3))


@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_chunked_logprobs_and_entropy_equal_plain_log_softmax(chunk_rows):
    torch.manual_seed(0)
    logits = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (7,))
    weights = torch.randn(7, dtype=torch.float64)

    logprobs = compute_logprobs(logits, labels, chunk_rows=chunk_rows)
    entropy = compute_entropy(logits, chunk_rows=chunk_rows)
    (grad_ours,) = torch.autograd.grad((logprobs * weights).sum() + (entropy * weights).sum(), logits)

    log_softmax = torch.log_softmax(logits, dim=-1)
    reference_logprobs = log_softmax.gather(-1, labels[:, None]).squeeze(-1)
    reference_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (grad_reference,) = torch.autograd.grad(
        (reference_logprobs * weights).sum() + (reference_entropy * weights).sum(), logits
    )
    torch.testing.assert_close(logprobs, reference_logprobs)
    torch.testing.assert_close(entropy, reference_entropy)
    torch.testing.assert_close(grad_ours, grad_reference)

    fused_logprobs, fused_entropy = compute_logprobs_and_entropy(logits, labels, chunk_rows=chunk_rows)
    (grad_fused,) = torch.autograd.grad((fused_logprobs * weights).sum() + (fused_entropy * weights).sum(), logits)
    torch.testing.assert_close(fused_logprobs, reference_logprobs)
    torch.testing.assert_close(fused_entropy, reference_entropy)
    torch.testing.assert_close(grad_fused, grad_reference)


def test_fused_statistics_give_the_right_gradient_when_only_one_is_used():
    torch.manual_seed(3)
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([5, 0, 2, 2])
    logprobs, entropy = compute_logprobs_and_entropy(logits, labels, chunk_rows=3)
    (only_logprobs,) = torch.autograd.grad(logprobs.sum(), logits, retain_graph=True)
    (only_entropy,) = torch.autograd.grad(entropy.sum(), logits)
    torch.testing.assert_close(only_logprobs, torch.autograd.grad(compute_logprobs(logits, labels).sum(), logits)[0])
    torch.testing.assert_close(only_entropy, torch.autograd.grad(compute_entropy(logits).sum(), logits)[0])


def test_logprobs_and_entropy_pass_gradcheck():
    torch.manual_seed(1)
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 1, 1, 2])
    assert torch.autograd.gradcheck(lambda x: compute_logprobs(x, labels, chunk_rows=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: compute_entropy(x, chunk_rows=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: compute_logprobs_and_entropy(x, labels, chunk_rows=2), (logits,))


def _bytes_saved_for_backward(fn) -> int:
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


def test_bf16_logprobs_keep_no_float32_copy_of_the_logits_for_backward():
    rows, vocab = 64, 512
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,))
    one_fp32_copy = rows * vocab * 4

    naive = _bytes_saved_for_backward(lambda: torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).sum())
    ours = _bytes_saved_for_backward(lambda: compute_logprobs(logits, labels, chunk_rows=8).sum())
    ours_entropy = _bytes_saved_for_backward(lambda: compute_entropy(logits, chunk_rows=8).sum())
    ours_fused = _bytes_saved_for_backward(
        lambda: sum(t.sum() for t in compute_logprobs_and_entropy(logits, labels, chunk_rows=8))
    )

    assert naive >= one_fp32_copy  # the measurement sees the copy a plain log_softmax keeps
    assert ours < one_fp32_copy * 0.55  # the bf16 logits (half a copy) plus per-row scalars
    assert ours_entropy < one_fp32_copy * 0.55
    assert ours_fused < one_fp32_copy * 0.55


def test_bf16_logprobs_are_computed_in_float32():
    torch.manual_seed(2)
    logits = torch.randn(6, 50).to(torch.bfloat16)
    labels = torch.randint(0, 50, (6,))
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    result = compute_logprobs(logits, labels, chunk_rows=4)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected)


def test_a_minus_inf_logit_adds_nothing_to_entropy_or_its_gradient():
    finite = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    masked = torch.tensor([[0.5, float("-inf"), -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([2])
    logprob, entropy = compute_logprobs_and_entropy(finite, labels)
    masked_logprob, masked_entropy = compute_logprobs_and_entropy(masked, labels + 1)
    torch.testing.assert_close(masked_entropy, entropy)
    torch.testing.assert_close(masked_logprob, logprob)
    (logprob + entropy).sum().backward()
    (masked_logprob + masked_entropy).sum().backward()
    torch.testing.assert_close(masked.grad[0, [0, 2, 3]], finite.grad[0])
    assert masked.grad[0, 1] == 0


def test_compute_logprobs_rejects_mismatched_labels():
    with pytest.raises(ValueError, match=r"labels must have shape \[3\]"):
        compute_logprobs(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))


def test_empty_post_is_the_identity_without_entropy():
    logits = torch.randn(2, 3)
    pipeline = resolve_post([])
    assert pipeline(logits) is logits and not pipeline.wants_entropy
    assert resolve_post(None)(logits) is logits


def test_post_temperatures_compose_in_order():
    pipeline = resolve_post(
        [{"name": "temperature", "config": {"temperature": 2.0}}, {"name": "temperature", "config": {"temperature": 4}}]
    )
    torch.testing.assert_close(pipeline(torch.tensor([[8.0, -16.0]])), torch.tensor([[1.0, -2.0]]))


def test_post_compute_entropy_asks_for_entropy_and_compute_logprobs_changes_nothing():
    logits = torch.randn(2, 3)
    assert resolve_post(["compute_entropy"]).wants_entropy
    pipeline = resolve_post(["compute_logprobs"])
    assert pipeline(logits) is logits and not pipeline.wants_entropy


def test_unknown_post_processor_error_names_it_and_the_known_ones():
    message = r"post\[1\]: unknown post-processor 'top_k'; known: compute_entropy, compute_logprobs, temperature"
    with pytest.raises(PostProcessingError, match=message):
        resolve_post(["compute_logprobs", "top_k"])


# ---- the fused Triton kernels, under the interpreter -----------------------------------------------------

ROWS, VOCAB, BLOCK_V = 5, 1000, 256  # four tiles of 256, the last one partial


def _logits(dtype, seed=0, rows=ROWS, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, vocab, generator=g)).to(dtype)


def _labels(rows=ROWS, vocab=VOCAB):
    return torch.tensor([0, vocab - 1, 3, vocab // 2, vocab - 2])[:rows]  # the first and last column included


def _close(dtype):
    # fp32: the same math in another order. bf16/fp16 gradients: also rounded once to the logits' dtype.
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)


def check_kernel_statistics_equal_the_torch_path(dtype, want_entropy, with_labels, block_v):
    from arctic_rl_core.processors.softmax_kernels import softmax_statistics

    logits, labels = _logits(dtype), _labels() if with_labels else None
    logsumexp, logprobs, entropy = softmax_statistics(logits, labels, want_entropy, block_v=block_v)
    expected = post._statistics_in_torch(logits, labels, want_entropy, rows=2)
    for ours, theirs in zip((logsumexp, logprobs, entropy), expected):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def check_kernel_gradient_equals_the_torch_path(dtype, grad_logprobs, grad_entropy):
    from arctic_rl_core.processors.softmax_kernels import softmax_statistics, softmax_statistics_backward

    logits, labels = _logits(dtype), _labels()
    g = torch.Generator().manual_seed(1)
    g_logprobs = torch.randn(ROWS, generator=g) if grad_logprobs else None
    g_entropy = torch.randn(ROWS, generator=g) if grad_entropy else None
    logsumexp, _, entropy = softmax_statistics(logits, labels, True, block_v=BLOCK_V)
    grad = softmax_statistics_backward(logits, labels, logsumexp, entropy, g_logprobs, g_entropy, block_v=BLOCK_V)
    assert grad.dtype == dtype
    # torch's float32 computation on the same (bf16) logits
    expected = post._gradient_in_torch(logits.float(), labels, logsumexp, entropy, g_logprobs, g_entropy, rows=2)
    torch.testing.assert_close(grad.float(), expected, **_close(dtype))


def check_fused_autograd_equals_the_torch_path(dtype):
    """Through autograd: log-prob only, entropy only, both; from non-contiguous logits."""
    labels = _labels()
    grads = {}
    for fused in (True, False):
        logits = _logits(dtype).t().contiguous().t().requires_grad_()  # column-major: stride(-1) != 1
        logprobs, entropy = post._SoftmaxStatistics.apply(logits, labels, True, 2, fused)
        weights = torch.randn(ROWS, generator=torch.Generator().manual_seed(2))
        grads[fused] = [
            torch.autograd.grad(loss, logits, retain_graph=True)[0].float()
            for loss in ((logprobs * weights).sum(), (entropy * weights).sum(), (logprobs - entropy).sum())
        ]
        grads[fused].extend([logprobs.detach(), entropy.detach()])
    for ours, theirs in zip(grads[True], grads[False]):
        torch.testing.assert_close(ours, theirs, **_close(dtype))


def check_minus_inf_logits_keep_entropy_and_gradients_finite():
    from arctic_rl_core.processors.softmax_kernels import softmax_statistics, softmax_statistics_backward

    logits, labels = _logits(torch.float32), _labels()
    logits[:, 100:400] = float("-inf")  # a whole tile and parts of two more, as after top-k masking
    logits[2, :BLOCK_V] = float("-inf")  # a row whose first tile is all -inf
    logits[1, -1] = float("-inf")  # a -inf label: log p = -inf
    logsumexp, logprobs, entropy = softmax_statistics(logits, labels, True, block_v=BLOCK_V)
    assert torch.isfinite(entropy).all()
    expected = post._statistics_in_torch(logits, labels, True, rows=2)
    for ours, theirs in zip((logsumexp, logprobs, entropy), expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    ones = torch.ones(ROWS)
    grad = softmax_statistics_backward(logits, labels, logsumexp, entropy, ones, ones, block_v=BLOCK_V)
    assert torch.isfinite(grad).all() and (grad[:, 100:400] == 0).all()
    expected_grad = post._gradient_in_torch(logits, labels, logsumexp, entropy, ones, ones, rows=2)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def check_no_rows_give_empty_results():
    from arctic_rl_core.processors.softmax_kernels import softmax_statistics, softmax_statistics_backward

    logits, labels = torch.zeros(0, VOCAB), torch.zeros(0, dtype=torch.long)
    logsumexp, logprobs, entropy = softmax_statistics(logits, labels, True)
    assert logprobs.shape == entropy.shape == (0,)
    grad = softmax_statistics_backward(logits, labels, logsumexp, entropy, logprobs, entropy)
    assert grad.shape == (0, VOCAB)


KERNEL_CHECKS = {
    **{
        f"statistics[{str(d)[6:]},entropy={e},labels={lab},block={b}]": (
            check_kernel_statistics_equal_the_torch_path, (d, e, lab, b)
        )
        for d in (torch.float32, torch.bfloat16, torch.float16)
        for e, lab in ((True, True), (True, False), (False, True))
        for b in (BLOCK_V, None)  # None: one tile of 1024, partly masked
    },
    **{
        f"gradient[{str(d)[6:]},logprobs={lp},entropy={ent}]": (
            check_kernel_gradient_equals_the_torch_path, (d, lp, ent)
        )
        for d in (torch.float32, torch.bfloat16)
        for lp in (True, False)
        for ent in (True, False)
    },
    "autograd[float32]": (check_fused_autograd_equals_the_torch_path, (torch.float32,)),
    "autograd[bfloat16]": (check_fused_autograd_equals_the_torch_path, (torch.bfloat16,)),
    "minus_inf_logits": (check_minus_inf_logits_keep_entropy_and_gradients_finite, ()),
    "no_rows": (check_no_rows_give_empty_results, ()),
}  # fmt: skip


test_fused_kernel_under_the_interpreter_equals_the_torch_path = check_test(__file__, KERNEL_CHECKS)


@pytest.mark.parametrize(
    "entries, message",
    [
        (["temperature"], r"post\[0\] 'temperature': temperature: Field required"),
        ([{"name": "temperature", "config": {"temperature": -1}}], r"temperature: Input should be greater than 0"),
        ([{"name": "temperature", "config": {"temperature": 1, "tau": 2}}], r"tau: Extra inputs are not permitted"),
        ([{"name": "compute_entropy", "config": {"x": 1}}], r"'compute_entropy' takes no config"),
        ([{"name": "temperature", "cfg": {}}], r"post\[0\] must be a name or"),
        ([42], r"post\[0\] must be a name or"),
        ("temperature", r"post must be a list"),
    ],
)
def test_bad_post_entries_are_rejected_by_name(entries, message):
    with pytest.raises(PostProcessingError, match=message):
        resolve_post(entries)


if __name__ == "__main__":
    warnings.simplefilter("ignore", RuntimeWarning)  # numpy computes both sides of tl.where, 0 * -inf included
    report(KERNEL_CHECKS)
