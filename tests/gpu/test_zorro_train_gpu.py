"""ZoRRo Train on CUDA: FlashAttention varlen and compiled FlexAttention compute the forest's exact attention."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.models.forward import lm_head
from arctic_rl_core.models.forward import selected_hidden_states as plain_selected_hidden_states
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from arctic_rl_core.zorro.train import ForestAttention, build_prefix_forest, selected_hidden_states
from arctic_rl_core.zorro.train import attention as zorro_attention
from tests.prompt_rows import padded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def forest_batch(device):
    """A shared system prompt, two questions sampled 3 times each, responses of different lengths, right padding."""
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 1000, (200,), generator=gen).tolist()
    rows = []
    for question_length in (90, 130):
        prompt = system + torch.randint(3, 1000, (question_length,), generator=gen).tolist()
        for response_length in (60, 150, 101):
            rows.append((prompt, torch.randint(3, 1000, (response_length,), generator=gen).tolist()))
    return tuple(t.to(device) for t in padded(rows))


def rows_and_grads(model, forward, input_ids, attention_mask, select):
    model.zero_grad(set_to_none=True)
    rows = forward(model, input_ids, attention_mask, select)
    targets = torch.roll(input_ids, -1, dims=1)[select]
    logprobs = torch.log_softmax(lm_head(model)(rows), -1).gather(-1, targets[:, None]).squeeze(-1)
    advantages = torch.linspace(-1.0, 1.0, len(rows), device=rows.device)
    (-(logprobs * advantages).mean()).backward()
    return rows.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_flex_forest_matches_the_plain_forward_in_fp32(tmp_path):
    path = build_tiny_model(tmp_path / "qwen2", TinySpec(family="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    tensors = forest_batch(torch.device("cuda"))
    stats = build_prefix_forest(*tensors).stats
    assert stats.tokens_packed > 4 * 128  # several flex blocks: full, partial and skipped ones

    rows, grads = rows_and_grads(model, selected_hidden_states, *tensors)
    plain_rows, plain_grads = rows_and_grads(model, plain_selected_hidden_states, *tensors)
    assert model.config._attn_implementation == "zorro_sdpa"
    torch.testing.assert_close(rows, plain_rows, rtol=1e-4, atol=1e-4 * plain_rows.abs().max().item())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize(
    "window, split", [(None, False), (None, True), (100, False)], ids=["gathered", "cudnn-split", "window"]
)
def test_varlen_flash_kernel_matches_the_dense_forest_attention_and_its_gradients(window, split, monkeypatch):
    # Either layout, whatever the batch's size would pick: the gathered ancestors, or the cuDNN split.
    monkeypatch.setattr(zorro_attention, "SPLIT_MIN_PAIRS", 0 if split else 1 << 62)
    forest = build_prefix_forest(*forest_batch(torch.device("cpu")))
    assert int(forest.positions.max()) > 4 * 100
    cuda = torch.device("cuda")
    length = len(forest.token_ids)
    gen = torch.Generator(device=cuda).manual_seed(0)
    inputs = [
        torch.randn(1, heads, length, 64, device=cuda, generator=gen, dtype=torch.bfloat16).requires_grad_()
        for heads in (4, 2, 2)
    ]
    grad_out = torch.randn(1, length, 4, 64, device=cuda, generator=gen, dtype=torch.bfloat16)

    out = ForestAttention(forest, "varlen", cuda)(*inputs, scaling=0.125, sliding_window=window)
    grads = torch.autograd.grad(out, inputs, grad_out)
    reference_inputs = [t.detach().float().requires_grad_() for t in inputs]
    reference = ForestAttention(forest, "dense", cuda)(*reference_inputs, scaling=0.125, sliding_window=window)
    reference_grads = torch.autograd.grad(reference, reference_inputs, grad_out.float())

    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (reference, *reference_grads)):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("split", [False, True], ids=["gathered", "cudnn-split"])
def test_packed_forward_and_backward_never_make_the_host_wait(tmp_path, split, monkeypatch):
    """Once the forest is planned, a step queues all its work: a wait would drain the GPU's queue mid-step."""
    monkeypatch.setattr(zorro_attention, "SPLIT_MIN_PAIRS", 0 if split else 1 << 62)
    path = build_tiny_model(tmp_path / "qwen2", TinySpec(family="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    forest = build_prefix_forest(*forest_batch(torch.device("cpu")))
    from arctic_rl_core.zorro.train.forward import packed_selected_hidden_states

    packed_selected_hidden_states(model, forest, torch.device("cuda"), "varlen").float().sum().backward()  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = packed_selected_hidden_states(model, forest, torch.device("cuda"), "varlen")
        rows.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.shape[0] == int(forest.select_index.numel())
