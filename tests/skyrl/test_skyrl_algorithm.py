"""SkyRL's algorithm settings as an arctic loss; settings arctic cannot honour fail at startup, by name."""

from __future__ import annotations

import pytest

from arctic_rl_core.processors import resolve_loss
from arctic_rl_skyrl.algorithm import UnsupportedSkyRLSetting, check_supported
from arctic_rl_skyrl.config import ArcticSkyRLTrainConfig

BASE = ["trainer.policy.model.path=/models/tiny"]


def plan_for(*overrides: str):
    return check_supported(ArcticSkyRLTrainConfig.from_cli_overrides([*BASE, *overrides]))


def test_regular_ppo_with_skyrl_defaults_is_grpo_with_kl_to_the_reference():
    plan = plan_for()
    assert plan.loss_fn == "grpo"
    assert plan.config == {
        "eps_clip": 0.2,
        "eps_clip_high": 0.2,
        "loss_agg_mode": "token-mean",
        "kl_coef": 0.001,
        "kl_estimator": "k3",
        "entropy_coef": 0.0,
        "kl_agg_mode": "seq-mean-token-mean",
        "entropy_agg_mode": "token-mean",
    }
    assert plan.processing(rows=16)["config"]["num_sequences"] == 16
    assert plan.reference and not plan.rollout_correction and plan.post == []


def test_every_plan_is_a_valid_arctic_loss_config():
    for overrides in (
        (),
        ("trainer.algorithm.policy_loss_type=dual_clip",),
        ("trainer.algorithm.loss_reduction=seq_mean_token_sum_norm", "trainer.algorithm.max_seq_len=2048"),
        ("trainer.algorithm.off_policy_correction.tis_ratio_type=token",),
    ):
        plan = plan_for(*overrides)
        resolve_loss(plan.loss_fn).parse_config(plan.config)


def test_clip_higher_and_dual_clip_map_to_arctic_clips():
    plan = plan_for(
        "trainer.algorithm.policy_loss_type=dual_clip",
        "trainer.algorithm.eps_clip_low=0.1",
        "trainer.algorithm.eps_clip_high=0.28",
        "trainer.algorithm.clip_ratio_c=4.0",
    )
    assert (plan.config["eps_clip"], plan.config["eps_clip_high"], plan.config["clip_ratio_c"]) == (0.1, 0.28, 4.0)


@pytest.mark.parametrize(
    ("reduction", "mode"),
    [("token_mean", "token-mean"), ("sequence_mean", "seq-mean-token-mean")],
)
def test_loss_reduction_maps_to_arctic_aggregation(reduction, mode):
    assert plan_for(f"trainer.algorithm.loss_reduction={reduction}").config["loss_agg_mode"] == mode


def test_dr_grpo_normalizes_by_max_seq_len_through_the_padded_horizon():
    plan = plan_for(
        "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm",
        "trainer.algorithm.max_seq_len=1024",
        "trainer.max_prompt_length=256",
        "generator.sampling_params.max_generate_length=768",
    )
    assert plan.config["loss_agg_mode"] == "seq-mean-token-sum-norm" and plan.horizon == 1024


DR_GRPO = ("trainer.algorithm.loss_reduction=seq_mean_token_sum_norm", "trainer.max_prompt_length=256")


@pytest.mark.parametrize(
    ("overrides", "widest"),
    [
        (("generator.sampling_params.max_generate_length=768",), 1024),
        # Multi-turn: each turn's input reaches generator.max_input_length, then a full generation.
        (("generator.max_turns=4", "generator.max_input_length=2048", "generator.sampling_params.max_generate_length=256"), 2304),
        # SkyRL's agent loop appends an EOS after a generation that ends in a stop string.
        (("generator.sampling_params.max_generate_length=768", "generator.sampling_params.stop=['####']"), 1025),
    ],
)  # fmt: skip
def test_dr_grpo_max_seq_len_below_what_a_batch_reaches_is_refused_at_startup(overrides, widest):
    """arctic pads rows to max_seq_len; SkyRL only warns on a wider batch, arctic would fail mid-run."""
    assert plan_for(*DR_GRPO, *overrides, f"trainer.algorithm.max_seq_len={widest}").horizon == widest
    with pytest.raises(UnsupportedSkyRLSetting) as raised:
        plan_for(*DR_GRPO, *overrides, f"trainer.algorithm.max_seq_len={widest - 1}")
    assert f"trainer.algorithm.max_seq_len={widest - 1}" in str(raised.value)
    assert f"at least {widest}" in str(raised.value)


def test_dr_grpo_with_step_wise_trajectories_is_refused():
    """A step keeps its observation, which no setting bounds, so no max_seq_len is sure to fit every batch."""
    with pytest.raises(UnsupportedSkyRLSetting, match="generator.step_wise_trajectories"):
        plan_for(*DR_GRPO, "trainer.algorithm.max_seq_len=100000", "generator.step_wise_trajectories=true")


def test_kl_off_and_entropy_bonus_on():
    plan = plan_for(
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_entropy_loss=true",
        "trainer.algorithm.entropy_loss_coef=0.02",
    )
    assert plan.config["kl_coef"] == 0.0 and plan.config["entropy_coef"] == 0.02 and not plan.reference


def test_kl_in_reward_needs_no_reference_in_the_loss():
    plan = plan_for("trainer.algorithm.use_kl_loss=false", "trainer.algorithm.use_kl_in_reward=true")
    assert plan.config["kl_coef"] == 0.0 and not plan.reference


def test_token_tis_is_decoupled_ppo_with_a_truncated_behaviour_weight():
    plan = plan_for(
        "trainer.algorithm.off_policy_correction.tis_ratio_type=token",
        "trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high=3.0",
    )
    assert plan.rollout_correction
    assert (plan.config["behav_imp_weight_cap"], plan.config["behav_imp_weight_mode"]) == (3.0, "truncate")


def test_sampling_temperature_becomes_a_logit_post_processor_for_every_policy_forward():
    plan = plan_for("generator.sampling_params.temperature=0.7")
    expected = [{"name": "temperature", "config": {"temperature": 0.7}}]
    assert plan.post == expected and plan.forward_processing()["post"] == expected
    # SkyRL's reference worker computes its log-probs at temperature 1.0.
    assert plan.forward_processing(reference=True) is None


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.algorithm.policy_loss_type=gspo", "trainer.algorithm.policy_loss_type='gspo'"),
        ("trainer.algorithm.loss_reduction=prompt_mean", "trainer.algorithm.loss_reduction='prompt_mean'"),
        ("trainer.critic.model.path=/models/critic", "trainer.critic.model.path='/models/critic'"),
        ("trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.rank=8"),
        ("trainer.hf_save_interval=10", "trainer.hf_save_interval=10"),
        ("trainer.update_ref_every_epoch=true", "trainer.update_ref_every_epoch=True"),
        ("generator.sampling_params.min_p=0.05", "generator.sampling_params.min_p=0.05"),
        (
            "trainer.algorithm.off_policy_correction.tis_ratio_type=sequence",
            "trainer.algorithm.off_policy_correction.tis_ratio_type='sequence'",
        ),
        (
            "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric",
            "trainer.algorithm.off_policy_correction.sequence_mask_metric='geometric'",
        ),
        # Sampling params SkyRL's generator would send and arctic's sampler refuses at the first generate.
        (
            "generator.sampling_params.additional_kwargs={repetition_penalty: 1.1}",
            "generator.sampling_params.additional_kwargs={'repetition_penalty': 1.1}",
        ),
        ("generator.eval_sampling_params.min_p=0.1", "generator.eval_sampling_params.min_p=0.1"),
        (
            "generator.eval_sampling_params.additional_kwargs={frequency_penalty: 0.5}",
            "generator.eval_sampling_params.additional_kwargs={'frequency_penalty': 0.5}",
        ),
        (
            ("generator.inference_engine.enable_return_sample_support_set=true", "generator.sampling_params.top_k=20"),
            "generator.inference_engine.enable_return_sample_support_set=True",
        ),
        # Loss settings arctic's server rejects at the first fwd_bwd.
        (
            ("trainer.algorithm.policy_loss_type=dual_clip", "trainer.algorithm.clip_ratio_c=1.0"),
            "trainer.algorithm.clip_ratio_c=1.0",
        ),
        ("trainer.algorithm.kl_loss_coef=-0.1", "trainer.algorithm.kl_loss_coef=-0.1"),
        ("generator.sampling_params.temperature=0", "trainer.algorithm.temperature"),
    ],
)
def test_unsupported_setting_fails_at_startup_naming_it(override, named):
    with pytest.raises(UnsupportedSkyRLSetting) as raised:
        plan_for(*(override if isinstance(override, tuple) else (override,)))
    assert named in str(raised.value)


def test_dr_grpo_without_max_seq_len_is_refused():
    with pytest.raises(UnsupportedSkyRLSetting, match="max_seq_len"):
        plan_for("trainer.algorithm.loss_reduction=seq_mean_token_sum_norm")
