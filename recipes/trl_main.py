"""The TRL recipes' launcher: a Hydra app that builds GRPOConfig and ArcticGRPOTrainer from a recipe config.

    python -m recipes.trl_main --config-path $PWD/recipes/txt2sql/trl --config-name arctic_txt2sql
    python -m recipes.trl_main --config-path $PWD/recipes/txt2sql/trl --config-name arctic_txt2sql trainer=trl
    python -m recipes.trl_main --config-path $PWD/recipes/txt2sql/trl --config-name arctic_txt2sql \\
        resume_from_checkpoint=runs/txt2sql-trl/checkpoint-100

Every recipe config selects ``recipes/conf/trl_grpo.yaml``, which documents the
fields: the model, the parquet files of a recipe's data script, the module
whose ``compute_score`` is the reward, ``grpo`` (GRPOConfig's fields) and
``arctic`` (ArcticRLClientConfig's fields). ``trainer=trl`` runs the same
config on TRL's own GRPOTrainer. After training, ``<output_dir>/trainer_state.json``
holds every logged step. Run from the repository root.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

TRAINERS = ("arctic", "trl")


def reward_function(reward: DictConfig) -> Callable[..., list[float]]:
    """TRL's reward function for ``reward.module``'s ``compute_score``, logged under ``reward.name``."""
    from recipes.common.trl_reward import trl_reward_func

    module = importlib.import_module(reward.module)
    compute_score = getattr(module, "compute_score", None)
    if not callable(compute_score):
        raise ValueError(f"reward.module={reward.module!r} must define compute_score(data_source, solution_str, ...)")
    return trl_reward_func(compute_score, reward.name, **OmegaConf.to_container(reward.kwargs, resolve=True))


def _parquet_files(field: str, files: str | Sequence[str]) -> list[str]:
    paths = [os.path.expanduser(path) for path in ([files] if isinstance(files, str) else list(files))]
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{field}: {path!r} does not exist; write it with the recipe's data script "
                "(python -m recipes.<task>.data)"
            )
    return paths


def load_splits(data: DictConfig):
    """The train split, and the eval split when ``data.eval_files`` is set."""
    from datasets import load_dataset

    files = {"train": _parquet_files("data.train_files", data.train_files)}
    if data.eval_files is not None:
        files["eval"] = _parquet_files("data.eval_files", data.eval_files)
    loaded = load_dataset("parquet", data_files=files)
    return loaded["train"], loaded.get("eval")


def grpo_arguments(cfg: DictConfig) -> dict:
    """GRPOConfig's keyword arguments for ``cfg.trainer``.

    The recipes set ``grpo.use_cpu: true`` for ArcticGRPOTrainer, whose driver
    runs no model (the engines hold it). TRL's own GRPOTrainer runs the policy
    in this process, so ``trainer=trl`` turns ``use_cpu`` off: the model goes
    to the GPU, or stays on the CPU only for a recipe whose engines would
    (``arctic.device: cpu``, the CPU smoke configs). It generates with
    transformers (TRL's ``use_vllm`` default, false) in one process; pass
    ``grpo.use_vllm=true grpo.vllm_mode=colocate`` to sample with vLLM instead.
    """
    arguments = OmegaConf.to_container(cfg.grpo, resolve=True)
    if cfg.trainer == "trl":
        arguments["use_cpu"] = cfg.arctic.get("device") == "cpu"
    return arguments


def build_trainer(cfg: DictConfig):
    """The configured GRPOTrainer (``trainer=trl``) or ArcticGRPOTrainer (``trainer=arctic``), ready to train."""
    from trl import GRPOConfig, GRPOTrainer

    if cfg.trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, got {cfg.trainer!r}")
    train_dataset, eval_dataset = load_splits(cfg.data)
    arguments = dict(
        model=cfg.model,
        reward_funcs=reward_function(cfg.reward),
        args=GRPOConfig(**grpo_arguments(cfg)),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )
    if cfg.trainer == "trl":
        return GRPOTrainer(**arguments)

    from arctic_rl_core import ArcticRLClientConfig
    from arctic_rl_trl import ARCTIC_CHECKPOINT, ArcticGRPOTrainer

    arctic = OmegaConf.to_container(cfg.arctic, resolve=True)
    if cfg.resume_from_checkpoint:
        # The engine loads its weights and optimizer state as it starts; TRL restores the rest in train().
        arctic.setdefault("checkpoint_path", os.path.join(cfg.resume_from_checkpoint, ARCTIC_CHECKPOINT))
    return ArcticGRPOTrainer(**arguments, arctic_config=ArcticRLClientConfig(**arctic))


@hydra.main(version_base=None, config_path="conf", config_name="trl_grpo")
def main(cfg: DictConfig) -> None:
    trainer = build_trainer(cfg)
    try:
        trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
        trainer.save_state()
    finally:
        if cfg.trainer == "arctic":
            trainer.shutdown()


if __name__ == "__main__":
    main()
