"""The arctic backend's loss is SkyRL's: same mini-batch, same settings, same loss and gradients.

SkyRL's side runs its own functions as its trainer and FSDP policy worker do
for one mini-batch in one micro-batch: the loss reduction folded into the
advantages, the registered policy loss, and the worker's KL and entropy terms.
arctic's side is the adapter's path (``check_supported``, ``training_context``,
``model_batch``, ``LossPlan.processing``) into the ``grpo`` loss, with the
``LossInputs`` the training job builds. Both differentiate the same per-token
log-probs and entropies.
"""

from __future__ import annotations

import pytest
import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
    compute_approx_kl,
)
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from arctic_rl_core.processors import LossInputs, loss_mask_from_context, resolve_loss
from arctic_rl_skyrl.algorithm import check_supported
from arctic_rl_skyrl.batch import model_batch, response_columns, training_context
from arctic_rl_skyrl.config import ArcticSkyRLTrainConfig

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21, 22, 23], [22, 23, 24], [25], [26, 27, 28, 29, 30]]
ALL = [[1] * len(r) for r in RESPONSES]
ROW_1_FILTERED = [[0] * len(r) if i == 1 else [1] * len(r) for i, r in enumerate(RESPONSES)]  # zero-variance filter
NONE = [[0] * len(r) for r in RESPONSES]
# Short enough for Dr. GRPO's max_seq_len=16 to hold the widest row.
BASE = ["trainer.policy.model.path=/models/tiny", "trainer.max_prompt_length=4",
        "generator.sampling_params.max_generate_length=5"]  # fmt: skip
NO_KL = ["trainer.algorithm.use_kl_loss=false"]


def mini_batch(loss_masks: list[list[int]]) -> tuple[TrainingInputBatch, torch.Tensor, torch.Tensor]:
    """A SkyRL mini-batch, plus the current policy's log-probs and entropies over its response columns."""
    g = torch.Generator().manual_seed(0)
    rewards = [[0.0] * (len(r) - 1) + [1.0] for r in RESPONSES]
    sampled = [[-0.5] * len(r) for r in RESPONSES]
    ids, attention, response_mask, _, loss_mask, _, *_ = convert_prompts_responses_to_batch_tensors(
        0, PROMPTS, RESPONSES, rewards, loss_masks, sampled
    )
    rows, width = response_mask.shape

    def noise(scale: float) -> torch.Tensor:
        return -torch.rand(rows, width, generator=g) * scale * response_mask

    data = TrainingInputBatch({
        "sequences": ids, "attention_mask": attention, "response_mask": response_mask, "loss_mask": loss_mask,
        "advantages": torch.randn(rows, width, generator=g) * response_mask, "action_log_probs": noise(2),
        "base_action_log_probs": noise(2), "rollout_logprobs": noise(2),
    })  # fmt: skip
    data.metadata = {"response_length": width}
    return data, noise(2), -noise(3)


def skyrl_loss(cfg, data, logprobs, entropy) -> torch.Tensor:
    """SkyRL 0.4: trainer's advantage scaling for the mini-batch, then the policy worker on one micro-batch."""
    algorithm = cfg.trainer.algorithm
    mask = data["loss_mask"]
    advantages = apply_loss_reduction_to_advantages_minibatch(
        data["advantages"], mask, algorithm.loss_reduction, len(data), algorithm.max_seq_len
    )
    policy, _ = PolicyLossRegistry.get(algorithm.policy_loss_type)(
        logprobs, data["action_log_probs"], advantages, config=algorithm, loss_mask=mask,
        rollout_logprobs=data["rollout_logprobs"],
    )  # fmt: skip
    loss = policy
    if algorithm.use_kl_loss:
        kl = compute_approx_kl(
            logprobs, data["base_action_log_probs"], loss_mask=mask, kl_estimator_type=algorithm.kl_estimator_type
        )
        loss = loss + algorithm.kl_loss_coef * masked_mean(kl, mask, dim=-1).mean()
    if algorithm.use_entropy_loss:
        loss = loss - algorithm.entropy_loss_coef * masked_mean(entropy, mask)
    return loss


def arctic_loss(cfg, data, logprobs, entropy) -> torch.Tensor:
    """The adapter's batch and processing into arctic's loss, with the training job's LossInputs."""
    plan = check_supported(cfg)
    batch = model_batch(data, training_context(data, plan.reference, plan.rollout_correction), horizon=plan.horizon)
    processing = plan.processing(rows=len(batch["args"][0]))
    spec = resolve_loss(processing["loss_fn"])
    config = spec.parse_config(processing["config"])
    attention = batch["kwargs"]["attention_mask"]
    mask = loss_mask_from_context(batch["context"], attention)
    rows, width = attention.shape

    def shifted(response: torch.Tensor) -> torch.Tensor:
        """Response columns into the shifted [B, width] layout arctic's losses see."""
        columns = response_columns(data["sequences"].shape[1], response.shape[1])
        out = torch.cat([torch.zeros(rows, columns.start), response, torch.zeros(rows, width - columns.stop)], 1)
        return out * mask

    used = spec.required_context(config) | spec.optional_context(config)
    inputs = LossInputs(
        logprobs=shifted(logprobs), mask=mask,
        context={k: v.float() for k, v in batch["context"].items() if k in used},
        entropy=shifted(entropy) if config.needs_entropy() else None,
        global_tokens=float(mask.sum()), global_seqs=float((mask.sum(-1) > 0).sum()), horizon=width,
    )  # fmt: skip
    return spec(inputs, config).loss


CASES = {
    "token_mean": (NO_KL, ALL),
    "token_mean_row_filtered": (NO_KL, ROW_1_FILTERED),
    "sequence_mean_row_filtered": (NO_KL + ["trainer.algorithm.loss_reduction=sequence_mean"], ROW_1_FILTERED),
    "dr_grpo_row_filtered": (
        NO_KL + ["trainer.algorithm.loss_reduction=seq_mean_token_sum_norm", "trainer.algorithm.max_seq_len=16"],
        ROW_1_FILTERED,
    ),
    "token_mean_kl_row_filtered": (["trainer.algorithm.kl_loss_coef=0.5"], ROW_1_FILTERED),
    "sequence_mean_kl_and_entropy": (
        [
            "trainer.algorithm.loss_reduction=sequence_mean",
            "trainer.algorithm.kl_loss_coef=0.3",
            "trainer.algorithm.use_entropy_loss=true",
            "trainer.algorithm.entropy_loss_coef=0.5",
        ],
        ALL,
    ),  # fmt: skip
    "token_tis_dual_clip_sequence_mean": (
        NO_KL
        + [
            "trainer.algorithm.off_policy_correction.tis_ratio_type=token",
            "trainer.algorithm.policy_loss_type=dual_clip",
            "trainer.algorithm.loss_reduction=sequence_mean",
        ],
        ROW_1_FILTERED,
    ),  # fmt: skip
    "every_row_filtered": (NO_KL, NONE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_arctic_loss_and_gradients_equal_skyrls(case):
    overrides, loss_masks = CASES[case]
    cfg = ArcticSkyRLTrainConfig.from_cli_overrides([*BASE, *overrides])
    data, logprobs, entropy = mini_batch(loss_masks)
    results = []
    for loss_fn in (skyrl_loss, arctic_loss):
        leaves = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
        loss = loss_fn(cfg, data, *leaves)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        results.append((loss.detach(), *grads))
    (skyrl, *skyrl_grads), (arctic, *arctic_grads) = results
    if loss_masks is not NONE:
        assert skyrl.abs() > 1e-3
    torch.testing.assert_close(arctic, skyrl, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(arctic_grads, skyrl_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
