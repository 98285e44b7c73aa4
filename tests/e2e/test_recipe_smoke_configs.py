"""The recipes' launch configs compose and validate as their frameworks will read them, GPU ones included.

The GPU configs never run here; this is where a typo in one shows. verl's are
validated as ``main_ppo`` does in the driver (where the arctic backend maps
verl's settings and refuses what it cannot serve); TRL's become the
GRPOConfig and ArcticRLClientConfig ``recipes.trl_main`` builds, checked by
the same functions ArcticGRPOTrainer runs at construction. The CPU smoke
configs must keep the GPU run's recipe (reward, ZoRRo, data order) and shrink
only its size.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
TASKS = ("txt2sql", "long_context_qa")
REWARD_MODULES = {"gsm8k": "recipes.gsm8k.reward", "txt2sql": "recipes.txt2sql.reward",
                  "long_context_qa": "recipes.long_context_qa.reward"}  # fmt: skip


def composed(framework: str, task: str, name: str, *overrides: str):
    with initialize_config_dir(str(REPO / "recipes" / task / framework), version_base=None):
        return compose(name, overrides=list(overrides))


def verl_config(task: str, variant: str):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    # The CPU configs leave the model and data to their launch script.
    paths = ["actor_rollout_ref.model.path=/models/tiny", "data.train_files=/data/train.parquet",
             "data.val_files=/data/test.parquet"] if variant else []  # fmt: skip
    cfg = composed("verl", task, f"arctic_{task}{variant}", *paths)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return cfg


def trl_config(task: str, variant: str):
    overrides = ["model=/models/tiny", "data.train_files=/data/train.parquet"] if variant else []
    return composed("trl", task, f"arctic_{task}{variant}", *overrides)


@pytest.mark.parametrize("task", [*TASKS, "gsm8k"])
def test_verl_gpu_config_validates_on_eight_gpus_with_zorro_and_the_recipe_reward(task):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = verl_config(task, "")
    arctic = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).arctic
    assert (arctic.training_gpus, arctic.sampling_gpus, arctic.log_prob_gpus) == (8, 8, 8)
    assert arctic.zorro_train and arctic.sampling_engine == "vllm"
    assert cfg.actor_rollout_ref.model.path.startswith("Qwen/Qwen3-")
    assert cfg.reward.custom_reward_function.path == f"pkg://{REWARD_MODULES[task]}"


@pytest.mark.parametrize("task", TASKS)
def test_verl_cpu_config_keeps_the_gpu_recipe_and_shrinks_its_size(task):
    gpu, cpu = verl_config(task, ""), verl_config(task, "_cpu")
    assert cpu.reward.custom_reward_function == gpu.reward.custom_reward_function
    assert cpu.actor_rollout_ref.actor.arctic.zorro_train == gpu.actor_rollout_ref.actor.arctic.zorro_train
    assert cpu.data.shuffle == gpu.data.shuffle
    assert cpu.trainer.total_training_steps == 2 and cpu.trainer.test_freq == -1
    assert cpu.actor_rollout_ref.rollout.n == 2 and cpu.data.max_response_length <= 16


@pytest.mark.parametrize("task", [*TASKS, "gsm8k"])
@pytest.mark.parametrize("variant", ["", "_cpu"])
def test_every_recipe_turns_qwen3_thinking_off_in_verl_and_trl(task, variant):
    # The prompts ask for the answer in the recipe's format; thinking mode spends the budget elsewhere.
    assert verl_config(task, variant).data.apply_chat_template_kwargs.enable_thinking is False
    assert trl_config(task, variant).grpo.chat_template_kwargs.enable_thinking is False


@pytest.mark.parametrize("task", [*TASKS, "gsm8k"])
def test_trl_optimizes_like_verl_for_the_same_recipe(task):
    # TRL's TrainingArguments default to a linear decay to 0 and weight decay 0; verl (and SkyRL)
    # run a constant learning rate with weight decay 0.01.
    from trl import GRPOConfig

    verl_optim = verl_config(task, "").actor_rollout_ref.actor.optim
    args = GRPOConfig(**OmegaConf.to_container(trl_config(task, "").grpo, resolve=True))
    assert verl_optim.lr_scheduler_type == "constant" and args.lr_scheduler_type == "constant"
    assert args.weight_decay == verl_optim.weight_decay == 0.01
    assert args.learning_rate == verl_optim.lr
    assert not args.warmup_steps and not args.warmup_ratio and not verl_optim.lr_warmup_steps_ratio


def test_verl_gsm8k_cpu_config_validates_and_keeps_the_gpu_recipe_but_a_gentler_reward():
    # Its own test: 3 steps with one validation, and a reward that pays for any number (a random
    # tiny model never answers right), as the config says.
    gpu, cpu = verl_config("gsm8k", ""), verl_config("gsm8k", "_cpu")
    assert cpu.reward.custom_reward_function.path == gpu.reward.custom_reward_function.path
    assert dict(cpu.reward.custom_reward_function.reward_kwargs) == {"method": "flexible", "format_score": 0.5}
    assert cpu.actor_rollout_ref.actor.arctic.zorro_train == gpu.actor_rollout_ref.actor.arctic.zorro_train
    assert cpu.data.shuffle == gpu.data.shuffle
    assert cpu.trainer.total_training_steps == 3 and cpu.trainer.test_freq == 3
    assert cpu.actor_rollout_ref.rollout.n == 4 and cpu.data.max_response_length <= 32


def test_long_context_qa_keeps_the_questions_on_one_context_together_in_every_framework_that_can():
    verl = verl_config("long_context_qa", "")
    trl = trl_config("long_context_qa", "")
    assert verl.data.shuffle is False and trl.grpo.shuffle_dataset is False
    assert verl.actor_rollout_ref.actor.arctic.zorro_train
    assert trl.arctic.training_config.zorro_train.enable


@pytest.mark.parametrize("task", [*TASKS, "gsm8k"])
@pytest.mark.parametrize("variant", ["", "_cpu"])
def test_trl_config_builds_a_grpo_config_and_deployment_arctic_grpo_trainer_accepts(task, variant):
    from trl import GRPOConfig

    from arctic_rl_core import ArcticRLClientConfig
    from arctic_rl_trl.compat import grpo_config_problems
    from arctic_rl_trl.engine_config import training_config_problems

    cfg = trl_config(task, variant)
    args = GRPOConfig(**OmegaConf.to_container(cfg.grpo, resolve=True))
    arctic = ArcticRLClientConfig(**OmegaConf.to_container(cfg.arctic, resolve=True))
    assert grpo_config_problems(args) == []
    assert training_config_problems(arctic.training_config, args) == []
    assert arctic.model_name == cfg.model
    assert cfg.reward.module == REWARD_MODULES[task] and cfg.trainer == "arctic"
    if variant:
        assert arctic.device == "cpu" and not args.bf16 and args.max_completion_length <= 16
    else:
        assert cfg.model.startswith("Qwen/Qwen3-") and args.bf16 and arctic.training_config["zorro_train"]["enable"]


@pytest.mark.parametrize("task", [*TASKS, "gsm8k"])
@pytest.mark.parametrize("variant", ["", "_cpu"])
def test_trainer_trl_runs_trls_own_grpo_trainer_where_the_engines_would_run(task, variant, monkeypatch):
    # grpo.use_cpu: true is for ArcticGRPOTrainer, whose driver holds no model; TRL's own
    # GRPOTrainer got it too and trained the GPU recipes on the CPU.
    import trl

    import recipes.trl_main as trl_main

    built = {}
    monkeypatch.setattr(trl, "GRPOTrainer", lambda **arguments: built.update(arguments) or "trl-trainer")
    monkeypatch.setattr(trl_main, "load_splits", lambda data: ([], None))
    monkeypatch.setattr(trl_main, "reward_function", lambda reward: None)
    cfg = trl_config(task, variant)
    assert cfg.grpo.use_cpu is True  # what ArcticGRPOTrainer's driver gets
    cfg.trainer = "trl"
    if not variant:
        cfg.grpo.bf16 = False  # GRPOConfig refuses bf16 on a machine without a GPU; the rest is the GPU recipe
    assert trl_main.build_trainer(cfg) == "trl-trainer"
    assert built["args"].use_cpu is bool(variant), "only the CPU smoke configs keep TRL's trainer on the CPU"
    assert built["args"].use_vllm is False
    assert trl_main.grpo_arguments(cfg)["use_cpu"] is bool(variant)
    cfg.trainer = "arctic"
    assert trl_main.grpo_arguments(cfg)["use_cpu"] is True


def test_trl_main_names_the_missing_data_file_and_how_to_make_it(tmp_path):
    from recipes.trl_main import build_trainer

    cfg = trl_config("txt2sql", "_cpu")
    cfg.data.train_files = str(tmp_path / "train.parquet")
    with pytest.raises(FileNotFoundError, match=r"data.train_files: .*train.parquet.* recipes.<task>.data"):
        build_trainer(cfg)


def test_trl_main_refuses_an_unknown_trainer_and_a_reward_module_without_compute_score():
    from recipes.trl_main import build_trainer, reward_function

    cfg = trl_config("txt2sql", "_cpu")
    cfg.trainer = "grpo"
    with pytest.raises(ValueError, match=r"trainer must be one of \('arctic', 'trl'\), got 'grpo'"):
        build_trainer(cfg)
    with pytest.raises(ValueError, match=r"reward.module='recipes.common.records' must define compute_score"):
        reward_function(OmegaConf.create({"module": "recipes.common.records", "name": "x", "kwargs": {}}))


def test_skyrl_data_binds_each_row_to_the_recipe_environment(tmp_path):
    from recipes.common.records import read_jsonl
    from recipes.skyrl_data import convert
    from recipes.txt2sql.data import prepare

    prepare(tmp_path / "verl", "synthetic", limit=2)
    written = convert(tmp_path / "verl", tmp_path / "skyrl", "txt2sql", ["train"])
    rows = read_jsonl(written["train"]["jsonl"])
    assert len(rows) == 2
    assert {row["env_class"] for row in rows} == {"txt2sql"}
    assert all(row["reward_spec"]["ground_truth"].lower().startswith("select") for row in rows)
    assert all(Path(row["extra_info"]["db_path"]).is_file() for row in rows)
    with pytest.raises(
        ValueError, match=r"env_class must be one of \('txt2sql', 'long_context_qa', 'gsm8k_recipe'\), got 'gsm8k'"
    ):
        convert(tmp_path / "verl", tmp_path / "skyrl", "gsm8k", ["train"])


def test_gsm8k_skyrl_launchers_score_with_the_recipe_reward_like_verl_and_trl(tmp_path):
    # They used skyrl-gym's own gsm8k environment, which scores "#### 42.0", "#### $18", "####42" as 0.
    from recipes.common.records import read_jsonl
    from recipes.gsm8k.skyrl.data import prepare
    from recipes.skyrl_data import REWARD_MODULES as SKYRL_REWARD_MODULES

    written = prepare(tmp_path, source="local", splits=["test"], limit=2)
    rows = read_jsonl(written["test"]["jsonl"])
    assert {row["env_class"] for row in rows} == {"gsm8k_recipe"}
    assert SKYRL_REWARD_MODULES["gsm8k_recipe"] == REWARD_MODULES["gsm8k"]
    for script in ("run_gpu.sh", "run_cpu_smoke.sh"):
        text = (REPO / "recipes" / "gsm8k" / "skyrl" / script).read_text()
        assert "environment.env_class=gsm8k_recipe" in text, script
        assert "trainer.override_entrypoint=recipes.skyrl_main" in text, script


def recorded_verl_launch(script: Path, tmp_path: Path, env: dict[str, str]) -> tuple[list[str], str]:
    """The main_ppo command line ``script`` runs, and its VERL_FILE_LOGGER_PATH, with ``python`` a recorder."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    stand_in = bin_dir / "python"
    stand_in.write_text(
        "#!/usr/bin/env bash\n"
        f'record="{records}/$(date +%s%N)"\n'
        'printf "%s\\0" "$@" > "$record.args"\n'
        'printf "%s" "${VERL_FILE_LOGGER_PATH:-}" > "$record.logger"\n'
    )
    stand_in.chmod(0o755)
    environment = {**os.environ, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    environment.pop("VERL_FILE_LOGGER_PATH", None)
    subprocess.run(["bash", str(script)], cwd=tmp_path, env=environment, check=True, capture_output=True, timeout=60)
    for args_file in sorted(records.glob("*.args")):
        args = args_file.read_bytes().decode().split("\0")[:-1]
        if args[:2] == ["-m", "verl.trainer.main_ppo"]:
            return args, args_file.with_suffix(".logger").read_text()
    raise AssertionError(f"{script} ran no verl.trainer.main_ppo")


@pytest.mark.parametrize("task", [*TASKS, "gsm8k"])
@pytest.mark.parametrize("script", ["run_cpu_smoke.sh", "run.sh"])
def test_verl_launchers_write_logs_checkpoints_and_hydra_outputs_under_their_output_dir(task, script, tmp_path):
    # A CPU smoke run wrote arctic_rl_txt2sql/qwen3_8b_grpo_spider.jsonl (verl's file logger:
    # <project_name>/<experiment_name>.jsonl in the current directory) into the repository.
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.parquet").touch()  # run.sh then skips its data preparation
    out = tmp_path / ("work" if script == "run_cpu_smoke.sh" else "out")
    env = {"WORK": str(out)} if script == "run_cpu_smoke.sh" else {"OUT": str(out), "DATA": str(data)}
    args, logger_path = recorded_verl_launch(REPO / "recipes" / task / "verl" / script, tmp_path, env)
    overrides = dict(arg.split("=", 1) for arg in args if "=" in arg)
    assert Path(logger_path).parent == out
    assert Path(overrides["trainer.default_local_dir"]).parent == out
    assert Path(overrides["hydra.run.dir"]).parent == out


def test_verl_gpu_launchers_default_to_runs_in_the_repository(tmp_path):
    for task in [*TASKS, "gsm8k"]:
        text = (REPO / "recipes" / task / "verl" / "run.sh").read_text()
        assert f'OUT="${{OUT:-$REPO/runs/{task}-verl}}"' in text
