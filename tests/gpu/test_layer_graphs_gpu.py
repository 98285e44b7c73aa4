"""CUDA graphs of the decoder layers: replays compute what the eager layers compute, for ZoRRo and the plain forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.models.forward import decoder_body, lm_head
from arctic_rl_core.models.forward import selected_hidden_states as plain_selected_hidden_states
from arctic_rl_core.models.layer_graphs import CaptureFailed, LayerGraphs, layer_graphs, release_layer_graphs
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from arctic_rl_core.zorro.train import attention as zorro_attention
from arctic_rl_core.zorro.train import build_prefix_forest
from arctic_rl_core.zorro.train import selected_hidden_states as zorro_selected_hidden_states
from tests.prompt_rows import padded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("qwen2") / "m", TinySpec(family="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    return model.train()


def grpo_rows(order=(0, 1, 2, 3, 4, 5), seed=0, first_tokens=(5, 900)):
    """Two prompts (120 and 170 tokens) sampled 3 times each with responses of 40-90 tokens; rows in ``order``.

    The prompts' first tokens set which one the forest packs first.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt_length, first in zip((120, 170), first_tokens):
        prompt = [first, *torch.randint(3, 1000, (prompt_length - 1,), generator=gen).tolist()]
        for response_length in (40, 90, 65):
            rows.append((prompt, torch.randint(3, 1000, (response_length,), generator=gen).tolist()))
    rows = [rows[i] for i in order]
    return tuple(t.cuda() for t in padded(rows))


def loss_of(model, forward, batch, graphs):
    input_ids, attention_mask, select = batch
    rows = forward(model, input_ids, attention_mask, select, cuda_graphs=graphs)
    targets = torch.roll(input_ids, -1, dims=1)[select]
    logprobs = torch.log_softmax(lm_head(model)(rows).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    advantages = torch.linspace(-1.0, 1.0, len(rows), device=rows.device)
    return -(logprobs * advantages).mean(), logprobs.detach()


def step(model, forward, batch, graphs):
    model.zero_grad(set_to_none=True)
    loss, logprobs = loss_of(model, forward, batch, graphs)
    loss.backward()
    return logprobs, grads(model)


def grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want):
    """Same kernels on the same inputs: equal up to the order of FlashAttention's atomic adds (bf16 noise)."""
    (logprobs, grads), (want_logprobs, want_grads) = got, want
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=2e-2)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert (grads[name] - grad).norm() <= 1e-2 * grad.norm() + 1e-6, name


@pytest.mark.parametrize(
    "forward, split",
    [
        (zorro_selected_hidden_states, False),
        (zorro_selected_hidden_states, True),
        (plain_selected_hidden_states, False),
    ],
    ids=["zorro-gathered", "zorro-cudnn-split", "plain"],
)
def test_replays_equal_the_eager_layers_across_batches_of_one_shape_and_weight_updates(
    model, forward, split, monkeypatch
):
    # ZoRRo's two varlen layouts, whatever this batch's size would pick: gathered ancestors, or the cuDNN split.
    for name in ("SPLIT_MIN_PAIRS", "SPLIT_MIN_PAIRS_GRAPHED"):
        monkeypatch.setattr(zorro_attention, name, 0 if split else 1 << 62)
    graphs = layer_graphs(decoder_body(model))
    assert graphs is not None
    layers = len(graphs.layers)
    batch = grpo_rows()
    eager = step(model, forward, batch, graphs=False)

    captures, replays = graphs.captures, graphs.replays
    assert_same(step(model, forward, batch, graphs=True), eager)  # first sight: eager
    assert (graphs.captures, graphs.replays) == (captures, replays)
    assert_same(step(model, forward, batch, graphs=True), eager)  # second: forward captured, backward eager
    assert (graphs.captures, graphs.replays) == (captures + layers, replays)
    for _ in range(2):  # the backward is captured before the first of these replays
        assert_same(step(model, forward, batch, graphs=True), eager)
    captures += 2 * layers
    replays += 2
    assert (graphs.captures, graphs.replays) == (captures, replays)

    # Other rows of the same shape. For ZoRRo, the other prompt packs first: the same lengths in
    # another layout, which the gathered layout replays and the split (its bounds moved) captures anew.
    other = grpo_rows(seed=1, first_tokens=(900, 5))
    if forward is zorro_selected_hidden_states:
        assert build_prefix_forest(*other).nodes != build_prefix_forest(*batch).nodes
    for _ in range(3 if split else 1):
        assert_same(step(model, forward, other, graphs=True), step(model, forward, other, graphs=False))
    captures += 2 * layers * split  # seen, captured, replayed
    replays += 1
    assert (graphs.captures, graphs.replays) == (captures, replays)

    # Weights updated in place, as an optimizer does: the replay reads them.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-2)
    batch = other if split else batch  # the split holds one shape's graphs at a time
    assert_same(step(model, forward, batch, graphs=True), step(model, forward, batch, graphs=False))
    assert graphs.replays == replays + 1


def test_a_second_forward_before_the_first_backward_runs_eagerly_and_both_gradients_are_right(model):
    graphs = layer_graphs(decoder_body(model))
    first, second = grpo_rows(), grpo_rows(order=(3, 4, 5, 0, 1, 2))
    for _ in range(3):  # seen, captured, replayed
        step(model, zorro_selected_hidden_states, first, graphs=True)
    model.zero_grad(set_to_none=True)
    want = [loss_of(model, zorro_selected_hidden_states, b, graphs=False)[0] for b in (first, second)]
    (want[0] + want[1]).backward()
    want_grads = grads(model)

    model.zero_grad(set_to_none=True)
    replays = graphs.replays
    loss_first, _ = loss_of(model, zorro_selected_hidden_states, first, graphs=True)
    loss_second, _ = loss_of(model, zorro_selected_hidden_states, second, graphs=True)
    assert graphs.replays == replays + 1  # the second pass found the first awaiting its backward
    loss_second.backward()
    loss_first.backward()
    for name, grad in want_grads.items():
        assert (grads(model)[name] - grad).norm() <= 1e-2 * grad.norm() + 1e-6, name


def test_release_gives_the_graph_pools_back(model):
    body = decoder_body(model)
    batch = grpo_rows()
    for _ in range(3):
        step(model, zorro_selected_hidden_states, batch, graphs=True)
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    release_layer_graphs(body)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < held
    # A new LayerGraphs starts over: eager, capture, replay.
    step(model, zorro_selected_hidden_states, batch, graphs=True)
    assert layer_graphs(body).captures == 0


def test_gradient_accumulators_held_from_before_the_capture_neither_break_it_nor_miss_a_gradient(model):
    """DeepSpeed's case: it makes each parameter's accumulator on the default stream and hooks it.

    A captured backward that reached those accumulators would make the default stream wait on
    the capture, which CUDA refuses; the layers were then left eager after a failed capture.
    """
    body = decoder_body(model)
    release_layer_graphs(body)
    layer_params = list(body.layers.parameters())
    accumulators = [p.expand_as(p).grad_fn.next_functions[0][0] for p in layer_params]
    hooked = []
    for acc in accumulators:
        acc.register_hook(lambda *_: hooked.append(1))
    batch = grpo_rows()
    eager = step(model, zorro_selected_hidden_states, batch, graphs=False)
    hooked.clear()
    for _ in range(4):  # seen, captured, replayed twice
        assert_same(step(model, zorro_selected_hidden_states, batch, graphs=True), eager)
    graphs = layer_graphs(body)
    assert graphs.replays == 2 and not graphs._uncapturable
    assert len(hooked) == 4 * len(layer_params)  # every step reached every parameter's own accumulator


def test_a_failed_capture_leaves_the_caching_allocator_and_the_random_generator_out_of_capture_mode(model):
    graphs = LayerGraphs(decoder_body(model))
    with pytest.raises(CaptureFailed, match="capture failed"):
        with graphs._capturing(torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()):
            torch.ones(8, device="cuda").sum().item()  # a host sync: CUDA refuses it inside a capture
    # Both failed an internal assertion and aborted the process while the allocator thought it captured.
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    assert torch.ones(8, device="cuda").sum().item() == 8
    # The random generator is out of capture mode too: it raised on the next eager draw.
    drawn = torch.randint(0, 10, (64,), device="cuda")
    assert 0 <= drawn.min().item() and drawn.max().item() < 10
    assert not torch.equal(drawn, torch.randint(0, 10, (64,), device="cuda"))  # and its offset still advances


def test_gradient_checkpointing_keeps_the_layers_eager(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert layer_graphs(decoder_body(model)) is None
        batch = grpo_rows()
        assert_same(
            step(model, zorro_selected_hidden_states, batch, graphs=True),
            step(model, zorro_selected_hidden_states, batch, graphs=False),
        )
    finally:
        model.gradient_checkpointing_disable()
