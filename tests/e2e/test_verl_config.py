"""The ``model_engine=arctic`` config group, composed by Hydra from the recipes, and what it refuses at startup.

Each config is validated the way ``verl.trainer.main_ppo`` does it in the
driver, before Ray starts (``verl.utils.config.validate_config``): that is
where the arctic actor config maps verl's settings and refuses the ones
arctic-rl cannot serve, naming them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from arctic_rl_verl.config import ArcticActorConfig, ArcticEngineConfig
from arctic_rl_verl.mapping import UnsupportedVerlSetting

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k" / "verl"
PATHS = [
    "actor_rollout_ref.model.path=/models/tiny",
    "data.train_files=/data/train.parquet",
    "data.val_files=/data/test.parquet",
]


def config(name: str, *overrides: str):
    with initialize_config_dir(str(RECIPE), version_base=None):
        return compose(name, overrides=[*PATHS, *overrides])


def validated_actor(name: str, *overrides: str) -> ArcticActorConfig:
    cfg = config(name, *overrides)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_cpu_recipe_maps_verl_settings_onto_the_grpo_processor():
    actor = validated_actor("arctic_gsm8k_cpu")
    assert isinstance(actor.engine, ArcticEngineConfig) and actor.engine.strategy == "arctic"
    assert actor.arctic.loss_config == {
        "eps_clip": 0.2,
        "eps_clip_high": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coef": 0,
        "kl_coef": 0.001,
        "kl_estimator": "k3",
    }
    assert not actor.arctic.decoupled_ppo
    assert actor.arctic.optimizer_steps_per_training_step == 1


def test_gpu_recipe_validates_with_four_optimizer_steps_per_training_step():
    actor = validated_actor("arctic_gsm8k")
    assert (actor.arctic.training_gpus, actor.arctic.sampling_gpus, actor.arctic.log_prob_gpus) == (8, 8, 8)
    assert actor.arctic.optimizer_steps_per_training_step == 256 // 64


def test_verl_clip_higher_and_token_tis_become_clip_bounds_and_a_behaviour_weight_cap():
    actor = validated_actor(
        "arctic_gsm8k_cpu",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.5",
    )
    assert actor.arctic.loss_config["eps_clip_high"] == 0.28
    assert actor.arctic.loss_config["behav_imp_weight_cap"] == 2.5
    assert actor.arctic.decoupled_ppo


REFUSED = {
    "algorithm.adv_estimator": ["algorithm.adv_estimator=gae"],
    "critic.enable": ["critic.enable=true"],
    "actor_rollout_ref.actor.policy_loss.loss_mode": ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
    "actor_rollout_ref.actor.loss_agg_mode": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "actor_rollout_ref.actor.kl_loss_type": ["actor_rollout_ref.actor.kl_loss_type=k3+"],
    "actor_rollout_ref.actor.arctic.log_prob_gpus": ["actor_rollout_ref.actor.arctic.log_prob_gpus=0"],
    "actor_rollout_ref.model.lora_rank": ["actor_rollout_ref.model.lora_rank=8"],
    "actor_rollout_ref.rollout.name": ["actor_rollout_ref.rollout.name=vllm"],
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
    "trainer.n_gpus_per_node": ["trainer.n_gpus_per_node=2"],
    "trainer.v1.trainer_mode": ["trainer.v1.trainer_mode=colocate_async"],
    "algorithm.rollout_correction.rollout_is": ["algorithm.rollout_correction.rollout_is=sequence"],
    "algorithm.rollout_correction.rollout_is_threshold": [
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
    ],
    "actor_rollout_ref.actor.optim.optimizer": ["actor_rollout_ref.actor.optim.optimizer=AdamW8bit"],
}


def refusal(error: BaseException) -> UnsupportedVerlSetting | None:
    """The UnsupportedVerlSetting behind ``error`` (Hydra's instantiate wraps what a config's constructor raises)."""
    while error is not None and not isinstance(error, UnsupportedVerlSetting):
        error = error.__cause__
    return error


@pytest.mark.parametrize("setting", list(REFUSED))
def test_unsupported_verl_setting_fails_at_startup_naming_it(setting):
    with pytest.raises(Exception) as raised:
        validated_actor("arctic_gsm8k_cpu", *REFUSED[setting])
    refused = refusal(raised.value)
    assert refused is not None, f"not refused by the arctic backend: {raised.value!r}"
    assert refused.path == setting
    assert str(refused).startswith(f"{setting}=")
    assert setting in str(raised.value)  # what the user reads names it too


def test_an_invalid_arctic_setting_fails_at_startup_naming_it():
    with pytest.raises(Exception) as raised:
        validated_actor("arctic_gsm8k_cpu", "actor_rollout_ref.actor.arctic.sampling_engine=sglang")
    assert "actor_rollout_ref.actor.arctic.sampling_engine='sglang': expected one of" in str(raised.value)
