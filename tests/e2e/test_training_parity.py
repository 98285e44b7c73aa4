"""The training engine computes what a plain-torch loop would: GRPO gradients, and ZoRRo on vs off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arctic_rl_core import create_arctic_rl_client
from tests.e2e.conftest import run
from tests.e2e.test_core_runtime import remote_config

pytestmark = pytest.mark.slow

# A large SGD step makes the update dominate the weights, so reading it back (before - after) loses
# no precision to fp32 cancellation; the gradient is update / lr.
LR = 1e3
SGD = {"dtype": "float32", "optimizer": {"name": "sgd", "lr": LR, "gradient_clipping": 0.0}}


def grpo_batch(prompt_len: int = 24, rows: int = 4, seed: int = 0) -> dict:
    """A GRPO group: one shared prompt, four responses of different lengths, right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 1000, (prompt_len,), generator=g)
    lengths = [5, 3, 6, 2][:rows]
    width = prompt_len + max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention, response = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :prompt_len] = prompt
        ids[i, prompt_len : prompt_len + n] = torch.randint(3, 1000, (n,), generator=g)
        attention[i, : prompt_len + n] = 1
        response[i, prompt_len : prompt_len + n] = 1
    old = -5.0 + 0.3 * torch.randn(rows, width, generator=g)
    return {
        "args": [ids],
        "kwargs": {"attention_mask": attention},
        "context": {"advantages": torch.tensor([1.0, -0.5, 0.8, -1.3][:rows]), "response_mask": response,
                    "old_log_probs_shifted": old},
    }  # fmt: skip


def plain_torch_grpo_gradients(model_path: str, batch: dict, eps: float = 0.2) -> dict[str, torch.Tensor]:
    """GRPO (token-mean, clipped ratio) written out in plain torch, on the HF model itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids, attention = batch["args"][0], batch["kwargs"]["attention_mask"]
    response, old, advantages = (batch["context"][k] for k in ("response_mask", "old_log_probs_shifted", "advantages"))
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = response[:, 1:].float()
    ratio = torch.exp(logprobs - old[:, :-1])
    surrogate = torch.maximum(-advantages[:, None] * ratio, -advantages[:, None] * ratio.clamp(1 - eps, 1 + eps))
    loss = (surrogate * mask).sum() / mask.sum()
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def checkpoint_weights(directory: Path) -> dict[str, torch.Tensor]:
    tag = (directory / "latest").read_text()
    return torch.load(directory / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]


# Jobs of their own, on the session's HTTP server (start-up is the slow part).
on_the_http_server = pytest.mark.parametrize("client", ["http"], indirect=True)


@on_the_http_server
def test_fwd_bwd_grpo_gradients_equal_a_plain_torch_reimplementation(client, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = grpo_batch()

    async def train_one_sgd_step() -> dict:
        other = create_arctic_rl_client(remote_config(client, training_gpus=1, training_config=SGD))
        try:
            out = await other.fwd_bwd(batch, {"loss_fn": "grpo", "config": {"eps_clip": 0.2}})
            await other.step()
            await other.save_checkpoint(path=str(tmp_path / "ckpt"))
            return out
        finally:
            await other.shutdown()

    out = run(train_one_sgd_step())
    before = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    after = checkpoint_weights(tmp_path / "ckpt")
    expected = plain_torch_grpo_gradients(tiny_model, batch)
    assert out["metrics"]["clip_frac"] > 0  # the clipping branch is exercised
    for name, grad in expected.items():
        engine_grad = (before[name].detach() - after[name]) / LR
        scale = grad.norm().clamp_min(1e-12)
        assert (engine_grad - grad).norm() / scale < 1e-5, name


@on_the_http_server
def test_grpo_through_the_client_with_zorro_on_equals_off(client):
    batch = grpo_batch(prompt_len=40)

    async def one_step(zorro: bool, cuda_graphs: bool = False) -> tuple[dict, torch.Tensor]:
        config = {
            **SGD,
            "optimizer": {"name": "sgd", "lr": 0.5, "gradient_clipping": 0.0},
            "zorro_train": {"enable": zorro},
            "cuda_graphs": cuda_graphs,
        }
        other = create_arctic_rl_client(remote_config(client, training_gpus=1, training_config=config))
        try:
            out = await other.fwd_bwd(batch, {"loss_fn": "grpo", "config": {"eps_clip": 0.2}})
            await other.step()
            after = await other.fwd_no_grad({"args": batch["args"], "kwargs": batch["kwargs"]}, reference_model=False)
            return out, after["log_probs_shifted"]
        finally:
            await other.shutdown()

    (off, lp_off), (on, lp_on) = run(one_step(False)), run(one_step(True))
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
    assert on["metrics"]["zorro_train/dedup_ratio"] > 1.5
    # The updated weights agree: their log-probs on the batch match to fp32 precision.
    assert (lp_on - lp_off).abs().max() < 1e-5 * lp_off.abs().max()
    # cuda_graphs reaches the engine, which says that nothing replayed here (no CUDA) and runs eagerly.
    graphed, lp_graphed = run(one_step(True, cuda_graphs=True))
    assert graphed["metrics"]["cuda_graphs/replayed"] == 0.0 and "cuda_graphs/replayed" not in on["metrics"]
    assert graphed["loss"] == on["loss"] and torch.equal(lp_graphed, lp_on)


@on_the_http_server
def test_micro_batches_and_zero_2_leave_the_update_unchanged(client, tmp_path):
    """One micro-batch on ZeRO-0 vs four (a 30-token budget: one row each) on ZeRO-2: the same SGD update."""
    batch = grpo_batch()

    async def update(name: str, **fields) -> dict[str, torch.Tensor]:
        other = create_arctic_rl_client(remote_config(client, training_gpus=1, **fields))
        try:
            out = await other.fwd_bwd(batch, {"loss_fn": "grpo", "config": {"loss_agg_mode": "seq-mean-token-mean"}})
            await other.step()
            await other.save_checkpoint(path=str(tmp_path / name))
            return out
        finally:
            await other.shutdown()

    whole = run(update("whole", training_config=SGD))
    split = run(
        update(
            "split",
            training_config={**SGD, "mb_spec": {"max_tokens_per_mb": 30}},
            ds_config={"zero_optimization": {"stage": 2}},
        )
    )
    assert (whole["micro_batches"], split["micro_batches"]) == (1, 4)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    one, four = checkpoint_weights(tmp_path / "whole"), checkpoint_weights(tmp_path / "split")
    for name, value in one.items():
        assert torch.allclose(four[name], value, rtol=0, atol=1e-6 * LR), name


@on_the_http_server
def test_a_call_whose_loss_mask_selects_nothing_trains_on_nothing_and_step_still_runs(client):
    """Every response filtered out (SkyRL's zero-variance filter, say): loss 0, no update, and step() runs."""
    batch = grpo_batch()
    batch["context"]["response_mask"] = torch.zeros_like(batch["context"]["response_mask"])
    forward = {"args": batch["args"], "kwargs": batch["kwargs"]}

    async def filtered_step() -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
        other = create_arctic_rl_client(remote_config(client, training_gpus=1, training_config=SGD))
        try:
            before = (await other.fwd_no_grad(forward, reference_model=False))["log_probs_shifted"]
            out = await other.fwd_bwd(batch, {"loss_fn": "grpo", "config": {"loss_agg_mode": "seq-mean-token-mean"}})
            stepped = await other.step()
            after = (await other.fwd_no_grad(forward, reference_model=False))["log_probs_shifted"]
            return out, stepped, before, after
        finally:
            await other.shutdown()

    out, stepped, before, after = run(filtered_step())
    assert out["loss"] == 0.0 and stepped["grad_norm"] == 0.0
    assert torch.equal(before, after)
