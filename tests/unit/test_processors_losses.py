"""Each built-in loss against numbers worked out by hand on tiny batches (one row unless said otherwise)."""

import math

import pytest
import torch

from arctic_rl_core.processors import LossInputs, kl_estimate, resolve_loss

LN2 = math.log(2.0)
NAN = float("nan")


def make_inputs(logprobs, mask, entropy=None, horizon=None, **context) -> LossInputs:
    mask = torch.tensor(mask, dtype=torch.float32)
    return LossInputs(
        logprobs=torch.tensor(logprobs, requires_grad=True),
        mask=mask,
        context={key: torch.tensor(value, dtype=torch.float32) for key, value in context.items()},
        entropy=entropy,
        global_tokens=float(mask.sum()),
        global_seqs=float((mask.sum(-1) > 0).sum()),
        horizon=horizon or mask.shape[-1],
    )


def run(loss: str, config: dict, inputs: LossInputs):
    spec = resolve_loss(loss)
    output = spec(inputs, spec.parse_config(config))
    output.loss.backward()
    return output


def metric(output, name: str) -> float:
    total, weight = output.metrics[name]
    return float(total / weight)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32), rtol=tol, atol=tol
    )


# ratios 1.5, 0.5, 1.1 against old log-probs of -2; the 4th position is padding full of garbage
RATIOS = [1.5, 0.5, 1.1]
CLIP_BATCH = dict(
    logprobs=[[-2 + math.log(r) for r in RATIOS] + [0.0]],
    mask=[[1, 1, 1, 0]],
    advantages=[[1.0, -1.0, 1.0, NAN]],
    old_log_probs_shifted=[[-2.0, -2.0, -2.0, -math.inf]],
)


def test_grpo_clips_ratio_outside_one_plus_minus_eps():
    inputs = make_inputs(**CLIP_BATCH)
    output = run("grpo", {"eps_clip": 0.2}, inputs)
    # token losses: max(-1.5, -1.2) = -1.2 (clipped), max(0.5, 0.8) = 0.8 (clipped), -1.1; mean = -0.5
    close(output.loss, -0.5)
    # clipped tokens carry no gradient; the third has -A * r / 3
    close(inputs.logprobs.grad, [[0.0, 0.0, -1.1 / 3, 0.0]])
    close(metric(output, "pg_loss"), -0.5)
    close(metric(output, "clip_frac"), 2 / 3)
    close(metric(output, "ratio_mean"), 3.1 / 3)
    close(output.maxima["ratio_max"], 1.5)
    # mean of r - 1 - ln r: (0.094535 + 0.193147 + 0.004690) / 3
    close(metric(output, "approx_kl"), 0.0974573)


def test_grpo_clip_higher_widens_only_the_upper_bound():
    inputs = make_inputs(**CLIP_BATCH)
    output = run("grpo", {"eps_clip": 0.2, "eps_clip_high": 0.6}, inputs)
    # 1.5 is inside [0.8, 1.6] now: -1.5; 0.5 is still clipped to 0.8
    close(output.loss, (-1.5 + 0.8 - 1.1) / 3)
    close(inputs.logprobs.grad, [[-1.5 / 3, 0.0, -1.1 / 3, 0.0]])
    close(metric(output, "clip_frac"), 1 / 3)


# ratio 5 on both tokens; advantages -1 and +1
DUAL_BATCH = dict(
    logprobs=[[-1.0 + math.log(5.0), -1.0 + math.log(5.0)]],
    mask=[[1, 1]],
    advantages=[[-1.0, 1.0]],
    old_log_probs_shifted=[[-1.0, -1.0]],
)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    inputs = make_inputs(**DUAL_BATCH)
    output = run("grpo", {"clip_ratio_c": 3.0}, inputs)
    # A < 0: min(max(5, 1.2), 3) = 3; A > 0: max(-5, -1.2) = -1.2, untouched by the dual clip
    close(output.loss, (3.0 - 1.2) / 2)
    close(inputs.logprobs.grad, [[0.0, 0.0]])
    close(metric(output, "dual_clip_frac"), 0.5)


def test_without_dual_clip_a_negative_advantage_loss_grows_with_the_ratio():
    inputs = make_inputs(**DUAL_BATCH)
    output = run("grpo", {}, inputs)
    close(output.loss, (5.0 - 1.2) / 2)
    close(inputs.logprobs.grad, [[5.0 / 2, 0.0]])
    assert "dual_clip_frac" not in output.metrics


def test_ppo_turns_the_dual_clip_on_by_default():
    close(run("ppo", {}, make_inputs(**DUAL_BATCH)).loss, 0.9)
    close(run("ppo", {"clip_ratio_c": None}, make_inputs(**DUAL_BATCH)).loss, 1.9)


# behaviour weights pi_prox / pi_old = 4 and 0.5; the current policy equals the proximal one (ratio 1)
DECOUPLED_BATCH = dict(
    logprobs=[[-2.0 + math.log(4.0), -2.0 - LN2]],
    mask=[[1, 1]],
    advantages=[1.0],  # per sequence
    old_log_probs_shifted=[[-2.0, -2.0]],
    prox_logp_shifted=[[-2.0 + math.log(4.0), -2.0 - LN2]],
)


@pytest.mark.parametrize(
    "config, token_losses, weight_mean",
    [
        ({}, [-4.0, -0.5], 2.25),
        ({"behav_imp_weight_cap": 2.0}, [-2.0, -0.5], 1.25),  # truncated: min(w, 2)
        ({"behav_imp_weight_cap": 2.0, "behav_imp_weight_mode": "mask"}, [0.0, -0.5], 0.25),  # w > 2 dropped
    ],
)
def test_decoupled_ppo_takes_the_ratio_against_prox_and_weights_by_the_capped_behaviour_ratio(
    config, token_losses, weight_mean
):
    inputs = make_inputs(**DECOUPLED_BATCH)
    output = run("grpo", config, inputs)
    close(output.loss, sum(token_losses) / 2)
    # -A * r * w with r = 1: the gradient of each token is its loss, over 2 tokens
    close(inputs.logprobs.grad, [[t / 2 for t in token_losses]])
    close(metric(output, "clip_frac"), 0.0)  # against old the ratios 4 and 0.5 would both be clipped
    close(metric(output, "behav_imp_weight"), weight_mean)


def test_on_policy_without_old_logprobs_is_reinforce_with_ratio_one():
    inputs = make_inputs(logprobs=[[-1.0, -3.0]], mask=[[1, 1]], advantages=[[2.0, -1.0]])
    output = run("grpo", {}, inputs)
    close(output.loss, (-2.0 + 1.0) / 2)
    close(inputs.logprobs.grad, [[-1.0, 0.5]])
    close(metric(output, "ratio_mean"), 1.0)
    close(metric(output, "approx_kl"), 0.0)
    close(metric(output, "clip_frac"), 0.0)


# log(ref / pi) = +ln 2 and -ln 2
KL_LOGPROBS = [-1.0, -1.0]
KL_REF = [-1.0 + LN2, -1.0 - LN2]


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [-0.693147, 0.693147]),
        ("kl", [-0.693147, 0.693147]),
        ("k2", [0.240227, 0.240227]),
        ("mse", [0.240227, 0.240227]),
        ("k3", [0.306853, 0.193147]),  # r - 1 - ln r for r = 2 and 1/2
        ("low_var_kl", [0.306853, 0.193147]),
        ("k3_unclamped", [0.306853, 0.193147]),
        ("abs", [0.693147, 0.693147]),
    ],
)
def test_kl_estimators_and_their_verl_aliases(estimator, expected):
    close(kl_estimate(torch.tensor(KL_LOGPROBS), torch.tensor(KL_REF), estimator), expected)


def test_k3_is_clamped_like_verl():
    # log r clamped to +-20 first, then the estimate to at most 10
    close(kl_estimate(torch.tensor([0.0, 0.0]), torch.tensor([30.0, -30.0]), "k3"), [10.0, 10.0])


def test_k3_unclamped_keeps_its_value_and_gradient_past_verls_clamp():
    # TRL's k3: logp = -5, ref = -1 gives e^4 - 4 - 1 = 49.6, and d/d logp = 1 - e^4 (clamped k3: 10, no gradient)
    logprobs = torch.tensor([-5.0], requires_grad=True)
    kl = kl_estimate(logprobs, torch.tensor([-1.0]), "k3_unclamped")
    kl.sum().backward()
    close(kl, [math.exp(4.0) - 5.0])
    close(logprobs.grad, [1.0 - math.exp(4.0)])


def test_grpo_kl_penalty_adds_kl_coef_times_the_mean_kl():
    inputs = make_inputs(logprobs=[KL_LOGPROBS], mask=[[1, 1]], advantages=[0.0], ref_log_probs_shifted=[KL_REF])
    output = run("grpo", {"kl_coef": 0.1, "kl_estimator": "k3"}, inputs)
    close(output.loss, 0.1 * (0.306853 + 0.193147) / 2)
    # d k3 / d logp = 1 - r
    close(inputs.logprobs.grad, [[0.1 * (1 - 2.0) / 2, 0.1 * (1 - 0.5) / 2]])
    close(metric(output, "kl"), 0.25)


def test_kl_is_reported_but_not_penalized_when_kl_coef_is_zero():
    inputs = make_inputs(logprobs=[KL_LOGPROBS], mask=[[1, 1]], advantages=[0.0], ref_log_probs_shifted=[KL_REF])
    output = run("grpo", {}, inputs)
    close(output.loss, 0.0)
    close(metric(output, "kl"), 0.25)


def test_entropy_bonus_lowers_the_loss_as_entropy_rises():
    entropy = torch.tensor([[1.0, 2.0]], requires_grad=True)
    inputs = make_inputs(logprobs=[[-1.0, -1.0]], mask=[[1, 1]], entropy=entropy, advantages=[0.0])
    output = run("grpo", {"entropy_coef": 0.01}, inputs)
    close(output.loss, -0.01 * 1.5)
    close(entropy.grad, [[-0.005, -0.005]])
    close(metric(output, "entropy"), 1.5)


def test_entropy_coef_without_entropy_from_the_engine_is_an_error():
    inputs = make_inputs(logprobs=[[-1.0]], mask=[[1]], advantages=[0.0])
    spec = resolve_loss("grpo")
    with pytest.raises(RuntimeError, match="entropy_coef=0.01 needs entropy"):
        spec(inputs, spec.parse_config({"entropy_coef": 0.01}))


# ratios 2 and 1/2, per-token advantages 1 and -2: Tinker's loss is -(2 * 1 + 0.5 * -2) = -1
IS_BATCH = dict(
    logprobs=[[-1.0 + LN2, -1.0 - LN2, 0.0]],
    mask=[[1, 1, 0]],
    advantages=[[1.0, -2.0, 5.0]],
    old_log_probs_shifted=[[-1.0, -1.0, -1.0]],
)


def test_importance_sampling_token_sum_is_tinkers_loss():
    inputs = make_inputs(**IS_BATCH)
    output = run("importance_sampling", {"loss_agg_mode": "token-sum"}, inputs)
    close(output.loss, -1.0)
    close(inputs.logprobs.grad, [[-2.0, 1.0, 0.0]])  # -A * r
    close(output.maxima["ratio_max"], 2.0)


def test_importance_sampling_defaults_to_the_token_mean():
    inputs = make_inputs(**IS_BATCH)
    output = run("importance_sampling", {}, inputs)
    close(output.loss, -0.5)
    close(inputs.logprobs.grad, [[-1.0, 0.5, 0.0]])
    close(metric(output, "ratio_mean"), 1.25)


def test_sft_is_the_mean_negative_log_likelihood_of_the_loss_tokens():
    inputs = make_inputs(logprobs=[[math.log(0.5), math.log(0.25), 0.0]], mask=[[1, 1, 0]])
    output = run("sft", {}, inputs)
    close(output.loss, (0.693147 + 1.386294) / 2)
    close(inputs.logprobs.grad, [[-0.5, -0.5, 0.0]])
    close(metric(output, "nll"), 1.039721)


# token losses: sequence 0 has [4], sequence 1 has [1, 2, 3], sequence 2 has none; T = 5
AGG_LOGPROBS = [[-4.0, 0, 0, 0, 0], [-1.0, -2.0, -3.0, 0, 0], [0, 0, 0, 0, 0]]
AGG_MASK = [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    "mode, expected, token_gradient",
    [
        ("token-mean", 10 / 4, [-1 / 4, -1 / 4]),
        ("token-sum", 10.0, [-1.0, -1.0]),
        ("seq-mean-token-sum", (4 + 6) / 2, [-1 / 2, -1 / 2]),
        ("seq-mean-token-mean", (4 + 2) / 2, [-1 / 2, -1 / 6]),  # each sequence weighs 1/2, split over its tokens
        ("seq-mean-token-sum-norm", 10 / (2 * 5), [-1 / 10, -1 / 10]),
    ],
)
def test_loss_agg_modes(mode, expected, token_gradient):
    inputs = make_inputs(logprobs=AGG_LOGPROBS, mask=AGG_MASK)
    output = run("sft", {"loss_agg_mode": mode}, inputs)
    close(output.loss, expected)
    first_token_of_each_sequence = inputs.logprobs.grad[[0, 1], [0, 0]]
    close(first_token_of_each_sequence, token_gradient)
    assert inputs.logprobs.grad[2].abs().sum() == 0


@pytest.mark.parametrize(
    "mode, expected",
    [("seq-mean-token-sum", (4 + 6) / 3), ("seq-mean-token-mean", (4 + 2) / 3), ("token-mean", 10 / 4)],
)
def test_num_sequences_counts_rows_without_loss_tokens_as_verl_and_skyrl_do(mode, expected):
    """verl's agg_loss and SkyRL's reductions divide by the mini-batch size: sequence 2, fully masked, counts."""
    from verl.trainer.ppo.core_algos import agg_loss

    inputs = make_inputs(logprobs=AGG_LOGPROBS, mask=AGG_MASK)
    output = run("sft", {"loss_agg_mode": mode, "num_sequences": 3}, inputs)
    close(output.loss, expected)
    nll = -torch.tensor(AGG_LOGPROBS)
    verl = agg_loss(nll, torch.tensor(AGG_MASK, dtype=torch.float32), mode, global_batch_size=3, batch_num_tokens=4)
    close(output.loss, float(verl))


def test_kl_and_entropy_take_their_own_aggregation_modes():
    """SkyRL: the policy term by loss_agg_mode, KL as a sequence mean of token means, entropy as a token mean."""
    entropy = torch.tensor([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]])
    mask = [[1, 1, 1], [1, 0, 0]]
    ref = [[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]]
    logprobs = [[-1.0, -1.0, -1.0 + LN2], [-1.0 - LN2, 0.0, 0.0]]  # k1 per token: 0, 0, ln2; -ln2
    config = {"kl_coef": 1.0, "kl_estimator": "k1", "entropy_coef": 1.0, "loss_agg_mode": "token-sum"}
    inputs = make_inputs(
        logprobs=logprobs, mask=mask, entropy=entropy, advantages=[0.0, 0.0], ref_log_probs_shifted=ref
    )
    mixed = run("grpo", {**config, "kl_agg_mode": "seq-mean-token-mean", "entropy_agg_mode": "token-mean"}, inputs)
    kl = ((LN2 / 3) + (-LN2)) / 2
    close(mixed.loss, kl - (1 + 2 + 3 + 5) / 4)
    inputs = make_inputs(
        logprobs=logprobs, mask=mask, entropy=entropy, advantages=[0.0, 0.0], ref_log_probs_shifted=ref
    )
    close(run("grpo", config, inputs).loss, (LN2 - LN2) - 11.0)  # both in token-sum, the policy term's mode
