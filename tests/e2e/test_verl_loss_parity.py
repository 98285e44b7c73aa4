"""The arctic backend's loss is verl's: same batch, same settings, same loss and gradients.

verl's own ``ppo_loss`` (the vanilla PPO clip policy loss, verl's KL and
entropy terms, rollout-correction weights from verl's helper) runs on a
jagged verl batch; arctic-rl's ``grpo`` processor runs on the padded, shifted
batch ``arctic_rl_verl.batch`` builds from it, with the config
``arctic_rl_verl.mapping`` derives from the same verl settings. Both see the
same current-policy log-probs, so this checks the mapping table and the
layout conversion together against verl 0.9.1's code.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from arctic_rl_core.processors import ClippedPolicyConfig, LossInputs, grpo_loss, loss_mask_from_context
from arctic_rl_verl.batch import SequenceLayout, loss_batch
from arctic_rl_verl.mapping import policy_loss

PROMPTS = [3, 5, 2, 4]
RESPONSES = [4, 2, 6, 3]
SEED = 0


def run_settings(**rollout_correction) -> dict:
    """verl settings outside the actor section, as the arctic config group interpolates them."""
    return {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
        "rollout_correction": {"rollout_is": None, "rollout_rs": None, "bypass_mode": False, **rollout_correction},
        "critic_enable": None,
        "n_gpus_per_node": 1,
        "nnodes": 1,
        "use_v1": True,
        "trainer_mode": "sync",
        "hybrid_engine": True,
        "rollout_name": "arctic",
        "rollout_tensor_model_parallel_size": 1,
        "rollout_data_parallel_size": 1,
        "rollout_pipeline_model_parallel_size": 1,
        "rollout_temperature": 1.0,
        "rollout_logprobs_mode": "processed_logprobs",
        "rollout_calculate_log_probs": True,
        "rollout_repetition_penalty": 1.0,
        "lora_rank": 0,
        "lora_config_rank": 0,
        "lora_adapter_path": None,
        "reward_model_enable": False,
        "distillation_enabled": False,
        "train_batch_size": 4,
        "max_actor_ckpt_to_keep": None,
    }


def actor_config(**fields) -> ActorConfig:
    return ActorConfig(strategy="arctic", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                       policy_loss=PolicyLossConfig(), **fields)  # fmt: skip


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class Scenario:
    """A verl mini-batch with current-policy log-probs spread around the clip bounds, and the tensors behind it."""

    def __init__(self):
        generator = torch.Generator().manual_seed(SEED)
        lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]

        def rand(n):
            return torch.rand(n, generator=generator)

        self.response_mask = [torch.ones(r, dtype=torch.long) for r in RESPONSES]
        self.response_mask[2][2] = 0  # a tool-output token inside a response: never trained on
        self.old = [-(rand(r) * 3 + 0.1) for r in RESPONSES]
        self.rollout = [o + (rand(len(o)) - 0.5) * 1.6 for o in self.old]
        self.ref = [o + (rand(len(o)) - 0.5) for o in self.old]
        self.advantages = [torch.full((r,), float(a)) for r, a in zip(RESPONSES, [1.5, -0.7, 0.4, -2.0])]
        # The current policy, per full sequence in verl's layout: entry t is log p(token t + 1).
        full = []
        for prompt, old, length in zip(PROMPTS, self.old, lengths):
            row = -(rand(length) * 3 + 0.1)
            row[prompt - 1 : prompt - 1 + len(old)] = old + (rand(len(old)) - 0.5) * 1.2
            full.append(row)
        self.offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        self.values = torch.cat(full)
        self.entropy = torch.cat([rand(length) * 4 for length in lengths])
        self.input_ids = [torch.randint(3, 500, (length,), generator=generator) for length in lengths]

    def verl_batch(self, rollout_is_threshold: float | None = None) -> TensorDict:
        fields = {
            "input_ids": nested(self.input_ids),
            "prompts": nested([ids[:p] for ids, p in zip(self.input_ids, PROMPTS)]),
            "responses": nested([ids[p:] for ids, p in zip(self.input_ids, PROMPTS)]),
            "response_mask": nested(self.response_mask),
            "old_log_probs": nested(self.old),
            "advantages": nested(self.advantages),
            "ref_log_prob": nested(self.ref),
            "rollout_log_probs": nested(self.rollout),
        }
        if rollout_is_threshold is not None:
            weights = []
            for old, rollout, mask in zip(self.old, self.rollout, self.response_mask):
                w, _ = compute_rollout_correction_weights(
                    (old - rollout)[None],
                    mask[None].float(),
                    rollout_is="token",
                    rollout_is_threshold=rollout_is_threshold,
                )
                weights.append(w[0])
            fields["rollout_is_weights"] = nested(weights)
        data = TensorDict(fields, batch_size=[len(PROMPTS)])
        tokens = int(sum(m.sum() for m in self.response_mask))
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens, global_batch_size=len(PROMPTS), temperature=1.0)
        return data


def verl_loss(actor: ActorConfig, scenario: Scenario, data: TensorDict, with_entropy: bool):
    leaf = scenario.values.clone().requires_grad_(True)
    output = {"log_probs": torch.nested.nested_tensor_from_jagged(leaf, offsets=scenario.offsets)}
    if with_entropy:
        output["entropy"] = torch.nested.nested_tensor_from_jagged(scenario.entropy, offsets=scenario.offsets)
    loss, _ = ppo_loss(actor, output, data)
    loss.backward()
    return loss.detach(), leaf.grad


def arctic_loss(actor: ActorConfig, settings: dict, scenario: Scenario, data: TensorDict, with_entropy: bool):
    mapped = policy_loss(actor, settings)
    layout = SequenceLayout.of(data)
    batch = loss_batch(data, layout, mapped.decoupled)
    mask = loss_mask_from_context(batch["context"], batch["kwargs"]["attention_mask"])
    leaf = scenario.values.clone().requires_grad_(True)
    width = layout.width
    grid = torch.zeros(len(PROMPTS), width)
    entropy = torch.zeros(len(PROMPTS), width)
    index = torch.cat([i * width + torch.arange(n) for i, n in enumerate(layout.lengths)])
    logprobs = grid.flatten().index_put((index,), leaf).view(len(PROMPTS), width)
    entropy = entropy.flatten().index_put((index,), scenario.entropy).view(len(PROMPTS), width)
    inputs = LossInputs(
        logprobs=logprobs,
        mask=mask,
        context=batch["context"],
        entropy=entropy if with_entropy else None,
        global_tokens=float(mask.sum()),
        global_seqs=float((mask.sum(-1) > 0).sum()),
        horizon=width,
    )
    loss = grpo_loss(inputs, ClippedPolicyConfig.model_validate(mapped.config)).loss
    loss.backward()
    return loss.detach(), leaf.grad


CASES = {
    "clip_higher_token_mean": dict(actor=dict(clip_ratio_low=0.2, clip_ratio_high=0.28), correction={}),
    "dual_clip_seq_mean_token_mean": dict(
        actor=dict(clip_ratio_c=2.0, loss_agg_mode="seq-mean-token-mean"), correction={}
    ),
    "kl_low_var_and_entropy_seq_mean_token_sum": dict(
        actor=dict(
            loss_agg_mode="seq-mean-token-sum",
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="low_var_kl",
            entropy_coeff=0.01,
        ),  # fmt: skip
        correction={},
    ),
    "kl_k1_token_sum": dict(
        actor=dict(loss_agg_mode="token-sum", use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="kl"), correction={}
    ),
    "token_tis": dict(actor=dict(clip_ratio_high=0.28), correction=dict(rollout_is="token", rollout_is_threshold=1.5)),
    # verl divides the seq-mean modes by the mini-batch's rows, a response its filters masked out included.
    "masked_response_seq_mean_token_mean": dict(
        actor=dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01),
        correction={},
        masked_row=1,
    ),
    "masked_response_seq_mean_token_sum": dict(
        actor=dict(loss_agg_mode="seq-mean-token-sum"), correction={}, masked_row=3
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_arctic_grpo_loss_and_gradients_equal_verl_ppo_loss(case):
    spec = CASES[case]
    actor = actor_config(**spec["actor"])
    settings = run_settings(**spec["correction"])
    scenario = Scenario()
    if "masked_row" in spec:
        scenario.response_mask[spec["masked_row"]].zero_()
    threshold = spec["correction"].get("rollout_is_threshold")
    with_entropy = actor.entropy_coeff != 0
    verl_value, verl_grad = verl_loss(actor, scenario, scenario.verl_batch(threshold), with_entropy)
    arctic_value, arctic_grad = arctic_loss(actor, settings, scenario, scenario.verl_batch(threshold), with_entropy)
    assert torch.isfinite(verl_value) and verl_value.abs() > 1e-3
    torch.testing.assert_close(arctic_value, verl_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(arctic_grad, verl_grad, rtol=1e-5, atol=1e-7)


def test_scenario_spreads_ratios_past_both_clip_bounds():
    """The parity above would be vacuous if no token were clipped."""
    scenario = Scenario()
    ratios = []
    for prompt, old, row_start, row_end in zip(PROMPTS, scenario.old, scenario.offsets[:-1], scenario.offsets[1:]):
        row = scenario.values[row_start:row_end]
        ratios.append((row[prompt - 1 : prompt - 1 + len(old)] - old).exp())
    ratios = torch.cat(ratios)
    assert (ratios > 1.28).any() and (ratios < 0.8).any()
