"""The ``model_engine=arctic`` config group, composed by Hydra from the recipes, and what it refuses at startup.

Each config is validated the way ``verl.trainer.main_ppo`` does it in the
driver, before Ray starts (``verl.utils.config.validate_config``): that is
where the arctic actor config maps verl's settings and refuses the ones
arctic-rl cannot serve, naming them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from arctic_rl_core.config import OptimizerConfig
from arctic_rl_core.engines.training.deepspeed_setup import build_optimizer, lr_multiplier
from arctic_rl_verl.config import ArcticActorConfig, ArcticEngineConfig
from arctic_rl_verl.mapping import UnsupportedVerlSetting, client_config, micro_batch_spec, optimizer_settings

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k" / "verl"
PATHS = [
    "actor_rollout_ref.model.path=/models/tiny",
    "data.train_files=/data/train.parquet",
    "data.val_files=/data/test.parquet",
]
MODEL = SimpleNamespace(local_path=None, path="/models/tiny")  # the fields of verl's HFModelConfig client_config reads


def config(name: str, *overrides: str):
    with initialize_config_dir(str(RECIPE), version_base=None):
        return compose(name, overrides=[*PATHS, *overrides])


def validated_config(name: str, *overrides: str):
    cfg = config(name, *overrides)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return cfg


def validated_actor(name: str, *overrides: str) -> ArcticActorConfig:
    return omega_conf_to_dataclass(validated_config(name, *overrides).actor_rollout_ref.actor)


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
        "num_sequences": 2 * 4,  # verl's global_batch_size: ppo_mini_batch_size x rollout.n
    }
    assert not actor.arctic.decoupled_ppo
    assert actor.arctic.optimizer_steps_per_training_step == 1


def test_gpu_recipe_validates_with_four_optimizer_steps_per_training_step():
    actor = validated_actor("arctic_gsm8k")
    assert (actor.arctic.training_gpus, actor.arctic.sampling_gpus, actor.arctic.log_prob_gpus) == (8, 8, 8)
    assert actor.arctic.optimizer_steps_per_training_step == 256 // 64


def _engine_as_verls_worker_fills_it(*overrides: str) -> ArcticEngineConfig:
    """The actor's engine config after verl's ActorRolloutRefWorker copied the actor's and rollout's sizes into it.

    As ``verl.workers.engine_workers.ActorRolloutRefWorker.init_model`` does, refusals included.
    """
    cfg = validated_config("arctic_gsm8k_cpu", *overrides)
    actor, rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), cfg.actor_rollout_ref.rollout
    assert actor.use_dynamic_bsz == rollout.log_prob_use_dynamic_bsz
    if actor.use_dynamic_bsz:
        assert rollout.log_prob_max_token_len_per_gpu is not None and actor.ppo_max_token_len_per_gpu is not None
    else:
        assert rollout.log_prob_micro_batch_size_per_gpu is not None and actor.ppo_micro_batch_size_per_gpu is not None
    engine = actor.engine
    engine.use_dynamic_bsz = actor.use_dynamic_bsz
    engine.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    engine.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine.infer_max_token_len_per_gpu = rollout.log_prob_max_token_len_per_gpu
    engine.infer_micro_batch_size_per_gpu = rollout.log_prob_micro_batch_size_per_gpu
    return engine


def test_micro_batches_follow_verls_sizes_per_rank():
    sizes = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5"]  # fmt: skip
    assert micro_batch_spec(_engine_as_verls_worker_fills_it(*sizes)) == {"max_rows_per_mb": 3, "max_rows_per_forward_mb": 5}  # fmt: skip
    budget = "actor_rollout_ref.actor.arctic.micro_batch_max_tokens=999"
    assert micro_batch_spec(_engine_as_verls_worker_fills_it(*sizes, budget)) == {"max_tokens_per_mb": 999}


DYNAMIC = [
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
]


def test_dynamic_bsz_gives_training_and_log_prob_forwards_verls_token_budgets_per_rank():
    # verl's rollout.log_prob_max_token_len_per_gpu defaults to the actor's ppo_max_token_len_per_gpu.
    assert micro_batch_spec(_engine_as_verls_worker_fills_it(*DYNAMIC)) == {"max_tokens_per_mb": 4096, "max_tokens_per_forward_mb": 4096}  # fmt: skip
    forward = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384"
    assert micro_batch_spec(_engine_as_verls_worker_fills_it(*DYNAMIC, forward)) == {"max_tokens_per_mb": 4096, "max_tokens_per_forward_mb": 16384}  # fmt: skip
    budget = "actor_rollout_ref.actor.arctic.micro_batch_max_tokens=999"
    assert micro_batch_spec(_engine_as_verls_worker_fills_it(*DYNAMIC, forward, budget)) == {"max_tokens_per_mb": 999}


def test_an_engine_config_without_a_log_prob_token_budget_leaves_forwards_the_training_one():
    engine = ArcticEngineConfig(use_dynamic_bsz=True, max_token_len_per_gpu=4096)
    assert engine.infer_max_token_len_per_gpu is None
    assert micro_batch_spec(engine) == {"max_tokens_per_mb": 4096}


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


def test_token_tis_with_temperature_top_k_and_top_p_gets_the_samplers_log_probs_in_verls_mode():
    """verl's vLLM rollout reports processed log-probs by default (rollout.logprobs_mode); so does arctic's sampler."""
    sampling = ["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_k=20",
                "actor_rollout_ref.rollout.top_p=0.9", "algorithm.rollout_correction.rollout_is=token"]  # fmt: skip
    actor = validated_actor("arctic_gsm8k_cpu", *sampling)
    assert actor.arctic.decoupled_ppo
    assert client_config(actor.arctic, MODEL, actor.optim).vllm_config["logprobs_mode"] == "processed_logprobs"
    raw = validated_actor("arctic_gsm8k_cpu", *sampling, "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs")
    assert client_config(raw.arctic, MODEL, raw.optim).vllm_config["logprobs_mode"] == "raw_logprobs"


@pytest.mark.parametrize(
    "schedule", [["lr_scheduler_type=cosine", "lr_warmup_steps_ratio=0.15", "min_lr_ratio=0.1"], ["lr_warmup_steps=4"]]
)
def test_every_optimizer_step_runs_at_verls_learning_rate(schedule):
    """verl steps its scheduler once per training step, after all its mini-batches; the engine does the same."""
    training_steps = 20
    optim_path = "actor_rollout_ref.actor.optim"
    actor = validated_actor(
        "arctic_gsm8k", f"{optim_path}.total_training_steps={training_steps}", *(f"{optim_path}.{s}" for s in schedule)
    )
    per_step = actor.arctic.optimizer_steps_per_training_step
    assert per_step == 4
    settings = OptimizerConfig(**optimizer_settings(actor.optim, per_step))
    model = torch.nn.Linear(2, 2)  # verl's AdamW decays every parameter, the bias too
    decay = {id(p) for g in build_optimizer(model.named_parameters(), settings, "cpu").param_groups for p in g["params"]
             if g["weight_decay"] == actor.optim.weight_decay > 0}  # fmt: skip
    assert decay == {id(model.weight), id(model.bias)}

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
    verl_engine = FSDPEngine.__new__(FSDPEngine)  # only its scheduler factory runs: it reads optimizer_config
    verl_engine.optimizer_config, verl_engine.rank = actor.optim, 1
    verl = verl_engine._build_lr_scheduler(optimizer)
    at = lr_multiplier(settings)
    for training_step in range(training_steps):
        for mini_batch in range(per_step):
            step = training_step * per_step + mini_batch
            assert settings.lr * at(step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
            optimizer.step()
        verl.step()


def test_vllm_reference_log_probs_are_refused_only_where_verl_asks_for_them_off_temperature_one():
    """The vLLM log-prob engine serves verl's reference at temperature 1.0, and any temperature without one."""
    engine = "actor_rollout_ref.actor.arctic.log_prob_engine=vllm"
    at_one = validated_actor("arctic_gsm8k_cpu", "actor_rollout_ref.actor.use_kl_loss=true", engine)
    assert at_one.arctic.log_prob_engine == "vllm" and at_one.arctic.loss_config["kl_coef"] > 0
    no_reference = validated_actor(
        "arctic_gsm8k_cpu",
        "actor_rollout_ref.actor.use_kl_loss=false",
        engine,
        "actor_rollout_ref.rollout.temperature=0.7",
    )
    assert no_reference.arctic.loss_config["kl_coef"] == 0.0


# (setting refused, the overrides that make verl ask for it); a setting may appear more than once.
REFUSED = [
    ("algorithm.adv_estimator", ["algorithm.adv_estimator=gae"]),
    ("critic.enable", ["critic.enable=true"]),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]),
    ("actor_rollout_ref.actor.loss_agg_mode", ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"]),
    ("actor_rollout_ref.actor.kl_loss_type", ["actor_rollout_ref.actor.kl_loss_type=k3+"]),
    ("actor_rollout_ref.actor.arctic.log_prob_gpus", ["actor_rollout_ref.actor.arctic.log_prob_gpus=0"]),
    ("actor_rollout_ref.model.lora_rank", ["actor_rollout_ref.model.lora_rank=8"]),
    ("actor_rollout_ref.rollout.name", ["actor_rollout_ref.rollout.name=vllm"]),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
    ),
    ("trainer.n_gpus_per_node", ["trainer.n_gpus_per_node=2"]),
    ("trainer.v1.trainer_mode", ["trainer.v1.trainer_mode=colocate_async"]),
    ("algorithm.rollout_correction.rollout_is", ["algorithm.rollout_correction.rollout_is=sequence"]),
    (
        "algorithm.rollout_correction.rollout_is_threshold",
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
        ],
    ),
    # IcePop's bounds [1, 10] in verl; Python's float reads "1_10" as 110.
    (
        "algorithm.rollout_correction.rollout_is_threshold",
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold='1_10'",
        ],
    ),
    # vLLM's logit modes: arctic's samplers report log-probs.
    ("actor_rollout_ref.rollout.logprobs_mode", ["actor_rollout_ref.rollout.logprobs_mode=processed_logits"]),
    # verl's reference log-probs are at the rollout temperature; arctic's vLLM log-prob engine applies none.
    (
        "actor_rollout_ref.actor.arctic.log_prob_engine",
        [
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.arctic.log_prob_engine=vllm",
            "actor_rollout_ref.rollout.temperature=0.7",
        ],
    ),
    ("actor_rollout_ref.actor.optim.optimizer", ["actor_rollout_ref.actor.optim.optimizer=AdamW8bit"]),
    (
        "actor_rollout_ref.actor.optim.zero_indexed_step",
        [
            "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
            "actor_rollout_ref.actor.optim.zero_indexed_step=false",
        ],
    ),
]


def refusal(error: BaseException) -> UnsupportedVerlSetting | None:
    """The UnsupportedVerlSetting behind ``error`` (Hydra's instantiate wraps what a config's constructor raises)."""
    while error is not None and not isinstance(error, UnsupportedVerlSetting):
        error = error.__cause__
    return error


@pytest.mark.parametrize(("setting", "overrides"), REFUSED, ids=[" ".join(overrides) for _, overrides in REFUSED])
def test_unsupported_verl_setting_fails_at_startup_naming_it(setting, overrides):
    with pytest.raises(Exception) as raised:
        validated_actor("arctic_gsm8k_cpu", *overrides)
    refused = refusal(raised.value)
    assert refused is not None, f"not refused by the arctic backend: {raised.value!r}"
    assert refused.path == setting
    assert str(refused).startswith(f"{setting}=")
    assert setting in str(raised.value)  # what the user reads names it too


def test_an_invalid_arctic_setting_fails_at_startup_naming_it():
    with pytest.raises(Exception) as raised:
        validated_actor("arctic_gsm8k_cpu", "actor_rollout_ref.actor.arctic.sampling_engine=sglang")
    assert "actor_rollout_ref.actor.arctic.sampling_engine='sglang': expected one of" in str(raised.value)


def saved_checkpoints(root: Path, step: int = 1) -> Path:
    """verl's trainer.default_local_dir after the arctic engine saved step ``step``; returns the actor directory."""
    actor = root / f"global_step_{step}" / "actor"  # verl's local_path for save_checkpoint
    (actor / f"global_step{step}").mkdir(parents=True)  # DeepSpeed's tag directory
    (actor / "latest").write_text(f"global_step{step}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return actor


CHECKPOINT_PATH = "actor_rollout_ref.actor.arctic.checkpoint_path"


@pytest.mark.parametrize(
    "given", ["actor/global_step1", "global_step_1", ".", "../copied/global_step1"], ids=lambda given: given
)
def test_a_checkpoint_path_that_would_not_resume_fails_at_startup_naming_the_directory(tmp_path, given):
    """The training worker resumes only from a directory holding 'latest'; elsewhere it silently starts fresh."""
    actor = saved_checkpoints(tmp_path / "ckpt")
    (tmp_path / "copied" / "global_step1").mkdir(parents=True)  # a tag directory copied out on its own
    path = (tmp_path / "ckpt" / given.replace("actor/", "global_step_1/actor/")).resolve()
    with pytest.raises(Exception) as raised:
        validated_actor("arctic_gsm8k_cpu", f"{CHECKPOINT_PATH}='{path}'")
    refused = refusal(raised.value)
    assert refused is not None, f"not refused by the arctic backend: {raised.value!r}"
    assert refused.path == CHECKPOINT_PATH
    assert str(refused).startswith(f"{CHECKPOINT_PATH}={str(path)!r}")
    instead = "<trainer.default_local_dir>/global_step_<N>/actor" if "copied" in given else repr(str(actor))
    assert f"set it to {instead}" in str(refused)


@pytest.mark.parametrize("given", ["resumes", "new", "empty"])
def test_a_checkpoint_path_to_resume_from_or_to_start_fresh_in_is_accepted(tmp_path, given):
    paths = {"resumes": saved_checkpoints(tmp_path / "ckpt"), "new": tmp_path / "new", "empty": tmp_path / "empty"}
    (tmp_path / "empty").mkdir()
    actor = validated_actor("arctic_gsm8k_cpu", f"{CHECKPOINT_PATH}='{paths[given]}'")
    assert actor.arctic.checkpoint_path == str(paths[given])


def test_verls_resume_request_names_the_directory_the_training_job_resumes_from(tmp_path):
    from arctic_rl_verl.engine import ArcticEngine

    local_path = str(saved_checkpoints(tmp_path))  # what verl's trainer passes: <default_local_dir>/global_step_1/actor
    engine = ArcticEngine(None, ArcticEngineConfig(), None, None)
    with pytest.raises(NotImplementedError) as raised:
        engine.load_checkpoint(local_path)
    assert f"{CHECKPOINT_PATH}={local_path!r}" in str(raised.value)
    assert "trainer.resume_mode=disable" in str(raised.value)
