"""Splitting a fwd_bwd call into micro-batches changes neither the loss, nor its gradients, nor its metrics."""

import pytest
import torch

from arctic_rl_core.processors import LossInputs, loss_mask_from_context, resolve_loss

B, T = 8, 12
# Four micro-batches of different sizes; each is cut to its own longest row, as an engine packs them.
SPLITS = [slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8)]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSSES = {
    "grpo": {
        "eps_clip_high": 0.28,
        "clip_ratio_c": 3.0,
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
        "behav_imp_weight_cap": 1.5,
    },
    "ppo": {},
    "importance_sampling": {},
    "sft": {},
}


def make_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, T + 1, (B,), generator=generator)
    prompts = torch.randint(1, 4, (B,), generator=generator)
    prompts[3] = lengths[3]  # a row with no response token: it must not count as a sequence
    positions = torch.arange(T)
    attention = (positions < lengths[:, None]).long()
    response = ((positions >= prompts[:, None]) & (positions < lengths[:, None])).long()
    noise = lambda scale: scale * torch.randn(B, T, generator=generator)  # noqa: E731
    logprobs = (noise(0.5) - 1.5).clamp(max=-0.01)
    return {
        "attention": attention,
        "mask": loss_mask_from_context({"response_mask": response}, attention),
        "logprobs": logprobs.requires_grad_(),
        "entropy": (1.0 + noise(0.3)).requires_grad_(),
        "context": {
            "advantages": noise(1.0),
            "old_log_probs_shifted": logprobs.detach() + noise(0.3),
            "prox_logp_shifted": logprobs.detach() + noise(0.2),
            "ref_log_probs_shifted": logprobs.detach() + noise(0.2),
        },
    }


def run_call(loss: str, config: dict, batch: dict, splits: list[slice]) -> dict:
    """What an engine does for one fwd_bwd call: every micro-batch, global denominators, summed results."""
    spec = resolve_loss(loss)
    parsed = spec.parse_config(config)
    mask = batch["mask"]
    global_tokens = float(mask.sum())
    global_seqs = float((mask.sum(-1) > 0).sum())
    batch["logprobs"].grad = None
    batch["entropy"].grad = None
    loss_total = torch.zeros(())
    sums: dict[str, list] = {}
    maxima: dict[str, torch.Tensor] = {}
    for rows in splits:
        width = int(batch["attention"][rows].sum(-1).max())
        cols = slice(0, width)
        mb_mask = mask[rows, cols]
        inputs = LossInputs(
            logprobs=batch["logprobs"][rows, cols] * mb_mask,
            mask=mb_mask,
            context={k: v[rows, cols] if v.dim() == 2 else v[rows] for k, v in batch["context"].items()},
            entropy=batch["entropy"][rows, cols] if spec.needs_entropy(parsed) else None,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            horizon=T,
        )
        output = spec(inputs, parsed)
        output.loss.backward()
        loss_total = loss_total + output.loss.detach()
        for name, (total, weight) in output.metrics.items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += float(total)
            acc[1] += float(weight)
        for name, value in output.maxima.items():
            maxima[name] = torch.maximum(maxima.get(name, value), value)
    return {
        "loss": loss_total,
        "logprobs_grad": batch["logprobs"].grad.clone(),
        "entropy_grad": None if batch["entropy"].grad is None else batch["entropy"].grad.clone(),
        "metrics": {name: total / weight for name, (total, weight) in sums.items()},
        "maxima": maxima,
    }


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_one_vs_four_micro_batches_give_the_same_loss_gradients_and_metrics(loss, mode):
    batch = make_batch()
    config = {**LOSSES[loss], "loss_agg_mode": mode}
    whole = run_call(loss, config, batch, [slice(0, B)])
    split = run_call(loss, config, batch, SPLITS)

    assert whole["logprobs_grad"].abs().sum() > 0
    torch.testing.assert_close(split["loss"], whole["loss"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split["logprobs_grad"], whole["logprobs_grad"], rtol=1e-6, atol=1e-9)
    if whole["entropy_grad"] is not None:
        torch.testing.assert_close(split["entropy_grad"], whole["entropy_grad"], rtol=1e-6, atol=1e-9)
    assert split["metrics"].keys() == whole["metrics"].keys()
    for name, value in whole["metrics"].items():
        assert split["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    for name, value in whole["maxima"].items():
        torch.testing.assert_close(split["maxima"][name], value)


def test_the_pg_loss_metric_is_the_policy_term_of_the_loss():
    batch = make_batch(seed=1)
    result = run_call("grpo", {"loss_agg_mode": "seq-mean-token-mean"}, batch, SPLITS)
    assert result["metrics"]["pg_loss"] == pytest.approx(float(result["loss"]), rel=1e-6)


def test_the_split_exercises_clipping_and_the_empty_row():
    batch = make_batch()
    assert batch["mask"][3].sum() == 0
    metrics = run_call("grpo", LOSSES["grpo"], batch, SPLITS)["metrics"]
    assert 0 < metrics["clip_frac"] < 1
    assert 0 < metrics["behav_imp_weight"]
