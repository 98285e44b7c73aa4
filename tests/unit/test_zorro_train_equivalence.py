"""ZoRRo Train returns the plain forward's rows and gradients, for every supported family, in fp32 on CPU."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.models.forward import lm_head
from arctic_rl_core.models.forward import selected_hidden_states as plain_selected_hidden_states
from arctic_rl_core.models.tiny import FAMILIES, TinySpec, build_tiny_model
from arctic_rl_core.zorro.train import build_prefix_forest, enable_forest_attention, selected_hidden_states
from tests.prompt_rows import padded

REL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def load(family: str, **config_overrides):
        if family not in cache:
            path = build_tiny_model(tmp_path_factory.mktemp(family), TinySpec(family=family))
            cache[family] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = cache[family]
        for key, value in config_overrides.items():
            setattr(model.config, key, value)
        return model

    return load


def tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=gen).tolist()


def exact_groups(gen):
    prompts = [tokens(gen, 9), tokens(gen, 6)]
    return [(p, tokens(gen, int(torch.randint(3, 7, (1,), generator=gen)))) for p in prompts for _ in range(3)]


def shared_system_prompt(gen):
    system = tokens(gen, 10)
    questions = [tokens(gen, n) for n in (3, 5, 4)]
    return [(system + q, tokens(gen, 4)) for q in questions] + [(system + questions[0], tokens(gen, 2))]


def multi_turn(gen):
    turn1, answer1, turn2 = tokens(gen, 6), tokens(gen, 4), tokens(gen, 3)
    history = turn1 + answer1 + turn2
    return [
        (turn1, answer1 + tokens(gen, 1)),
        (turn1, tokens(gen, 5)),
        (history, tokens(gen, 4)),
        (history, tokens(gen, 3)),
    ]


def nothing_shared(gen):
    return [([b + 3] + tokens(gen, 4 + b), tokens(gen, 3)) for b in range(3)]


CASES = {f.__name__: f for f in (exact_groups, shared_system_prompt, multi_turn, nothing_shared)}


def grpo_like_loss(model, rows, input_ids, select, advantages):
    """Policy-gradient loss on the response tokens' log-probs, as the engine computes it from the rows."""
    targets = torch.roll(input_ids, -1, dims=1)[select]
    logprobs = torch.log_softmax(lm_head(model)(rows), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return -(logprobs * advantages).mean()


def rows_and_grads(model, forward, input_ids, attention_mask, select):
    model.zero_grad(set_to_none=True)
    rows = forward(model, input_ids, attention_mask, select)
    advantages = torch.linspace(-1.0, 1.0, len(rows))
    grpo_like_loss(model, rows, input_ids, select, advantages).backward()
    return rows.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_rel(actual, expected, what):
    torch.testing.assert_close(
        actual, expected, rtol=REL, atol=REL * expected.abs().max().item(), msg=lambda m: f"{what}: {m}"
    )


def assert_same_rows_and_grads(model, input_ids, attention_mask, select, **zorro_kwargs):
    def zorro(*args):
        return selected_hidden_states(*args, **zorro_kwargs)

    rows, grads = rows_and_grads(model, zorro, input_ids, attention_mask, select)
    plain_rows, plain_grads = rows_and_grads(model, plain_selected_hidden_states, input_ids, attention_mask, select)
    assert_close_rel(rows, plain_rows, "rows")
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert_close_rel(grad, plain_grads[name], name)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("case", ["exact_groups", "shared_system_prompt", "multi_turn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_zorro_rows_and_gradients_equal_the_plain_forward(models, family, case, padding):
    tensors = padded(CASES[case](torch.Generator().manual_seed(0)), padding)
    assert build_prefix_forest(*tensors).stats.shared_tokens >= 16
    assert_same_rows_and_grads(models(family), *tensors)


@pytest.mark.parametrize("case", ["exact_groups", "shared_system_prompt", "multi_turn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_varlen_passes_give_the_plain_rows_and_gradients(models, family, case):
    # The GPU kernel's split into own and ancestor passes, run with its plain-torch ops.
    tensors = padded(CASES[case](torch.Generator().manual_seed(0)), "left")
    assert_same_rows_and_grads(models(family), *tensors, kernel="varlen")


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_with_nothing_shared_packs_without_sharing_and_still_matches(models, family):
    tensors = padded(nothing_shared(torch.Generator().manual_seed(0)), "left")
    assert build_prefix_forest(*tensors).stats.shared_tokens == 0
    assert_same_rows_and_grads(models(family), *tensors, min_shared_tokens=0)


def test_batch_with_nothing_shared_falls_back_to_the_plain_forward_with_an_info_log(models, caplog):
    model = models("qwen2")
    tensors = padded(nothing_shared(torch.Generator().manual_seed(0)), "right")
    with caplog.at_level(logging.INFO, logger="arctic_rl_core.zorro.train.forward"):
        rows = selected_hidden_states(model, *tensors)
    assert "running the plain forward" in caplog.text
    assert torch.equal(rows, plain_selected_hidden_states(model, *tensors))


def test_gradient_checkpointing_recomputes_the_packed_layers_exactly(models):
    model = models("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        assert_same_rows_and_grads(model, *padded(exact_groups(torch.Generator().manual_seed(1)), "right"))
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


@pytest.mark.parametrize("kernel", ["dense", "flex"])
def test_sliding_window_limits_packed_attention_like_the_plain_forward(models, kernel):
    model = models("mistral", sliding_window=5)
    tensors = padded(multi_turn(torch.Generator().manual_seed(2)), "left")
    try:
        if kernel == "dense":
            assert_same_rows_and_grads(model, *tensors)
        else:
            # FlexAttention has no CPU backward; its forward runs torch's exact reference here.
            with torch.no_grad():
                assert_close_rel(
                    selected_hidden_states(model, *tensors, kernel="flex"),
                    plain_selected_hidden_states(model, *tensors),
                    "rows",
                )
    finally:
        model.config.sliding_window = 4096


@pytest.mark.parametrize("case", ["exact_groups", "shared_system_prompt", "multi_turn"])
def test_flex_block_mask_gives_the_plain_forward_rows(models, case):
    model = models("llama")
    tensors = padded(CASES[case](torch.Generator().manual_seed(3)), "right")
    with torch.no_grad():
        rows = selected_hidden_states(model, *tensors, kernel="flex")
        assert_close_rel(rows, plain_selected_hidden_states(model, *tensors), "rows")


def test_enabling_forest_attention_leaves_plain_calls_unchanged(tmp_path):
    path = build_tiny_model(tmp_path / "qwen2", TinySpec(family="qwen2"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tensors = padded(exact_groups(torch.Generator().manual_seed(4)), "left")
    before = plain_selected_hidden_states(model, *tensors)
    assert enable_forest_attention(model) == "zorro_sdpa"
    assert enable_forest_attention(model) == "zorro_sdpa"
    assert torch.equal(plain_selected_hidden_states(model, *tensors), before)


def test_model_with_eager_attention_is_rejected_by_name(tmp_path):
    path = build_tiny_model(tmp_path / "llama", TinySpec(family="llama"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation.*'eager'"):
        selected_hidden_states(model, *padded(exact_groups(torch.Generator().manual_seed(0)), "right"))
