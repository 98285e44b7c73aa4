"""The SkyRL entrypoint of the arctic-rl backend: a user's SkyRL command plus one override.

    python -m skyrl.train.entrypoints.main_base <the usual overrides> \\
        trainer.override_entrypoint=arctic_rl_skyrl.entrypoint \\
        trainer.arctic_rl='{colocate: true, zorro_train: true}'      # optional: arctic settings

``main_base`` sees ``trainer.override_entrypoint`` and calls :func:`main`,
which parses the command line with ``ArcticSkyRLTrainConfig`` (SkyRL's config
plus ``trainer.arctic_rl``), refuses settings arctic cannot honour, starts Ray
(with CPU stand-ins for GPUs on a machine without CUDA) and runs
:class:`ArcticRLExp` as a Ray task, as ``main_base`` runs ``BasePPOExp``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import ray
from loguru import logger
from skyrl.train.dataset import PromptDataset
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import prepare_runtime_environment

from arctic_rl_core.server.ray_cluster import connect as connect_ray
from arctic_rl_skyrl.algorithm import check_supported
from arctic_rl_skyrl.config import ArcticSkyRLTrainConfig, placement
from arctic_rl_skyrl.inference_client import ArcticInferenceClient
from arctic_rl_skyrl.session import ArcticSession
from arctic_rl_skyrl.trainer import ArcticPPOTrainer

OVERRIDE_FLAG = "trainer.override_entrypoint="
STATUS_FILE = "arctic_rl_status.json"
# Forwarded to the Ray task: where SkyRL logs, and arctic-rl's own settings.
_FORWARDED_ENV_PREFIXES = ("ARCTIC_RL_", "TENSORBOARD_DIR", "WANDB_", "HF_")


class ArcticRLExp(BasePPOExp):
    """``BasePPOExp`` whose inference client, trainer and models are arctic-rl's."""

    def __init__(self, cfg):
        self.plan = check_supported(cfg)
        self.session = ArcticSession()
        super().__init__(cfg)

    def get_train_dataset(self) -> PromptDataset:
        dataset = self._prompt_dataset(self.cfg.data.train_data)
        if len(dataset) < self.cfg.trainer.train_batch_size:
            raise ValueError(
                f"data.train_data has {len(dataset)} prompts within trainer.max_prompt_length, fewer than "
                f"trainer.train_batch_size={self.cfg.trainer.train_batch_size}"
            )
        return dataset

    def get_eval_dataset(self) -> Optional[PromptDataset]:
        if self.cfg.trainer.eval_interval > 0 and self.cfg.data.val_data:
            return self._prompt_dataset(self.cfg.data.val_data)
        return None

    def _prompt_dataset(self, files: list[str]) -> PromptDataset:
        """SkyRL's dataset, filtered by ``data.dataloader.num_workers`` processes (``BasePPOExp`` always spawns 8)."""
        return PromptDataset(
            datasets=files,
            tokenizer=self.tokenizer,
            max_prompt_length=self.cfg.trainer.max_prompt_length,
            num_workers=max(1, self.cfg.data.dataloader.num_workers),
        )

    def get_colocate_pg(self, timeout: Optional[int] = None):
        """None: arctic places every engine itself, so SkyRL reserves no GPUs."""
        return None

    def get_inference_client(self) -> ArcticInferenceClient:
        where = placement(self.cfg)
        return ArcticInferenceClient(
            self.session,
            self.tokenizer,
            model_name=self.cfg.trainer.policy.model.path,
            sampling_gpus=where.sampling_gpus,
            colocated=where.colocate,
        )

    def get_trainer(
        self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client, generator, colocate_pg
    ):
        return ArcticPPOTrainer(
            cfg=cfg,
            tracker=tracker,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            inference_engine_client=inference_engine_client,
            generator=generator,
            colocate_pg=colocate_pg,
            session=self.session,
            plan=self.plan,
        )

    def _setup_trainer(self) -> ArcticPPOTrainer:
        """``BasePPOExp._setup_trainer`` without SkyRL's workers and vLLM servers: arctic runs both."""
        logger.info(self.get_cfg_as_str(self.cfg))
        os.makedirs(self.cfg.trainer.export_path, exist_ok=True)
        os.makedirs(self.cfg.trainer.ckpt_path, exist_ok=True)
        tracker = self.get_tracker()
        inference_client = self.get_inference_client()
        generator = self.get_generator(self.cfg, self.tokenizer, inference_client)
        trainer = self.get_trainer(
            cfg=self.cfg,
            tracker=tracker,
            tokenizer=self.tokenizer,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            inference_engine_client=inference_client,
            generator=generator,
            colocate_pg=None,
        )
        trainer.trajectory_logger = self.get_trajectory_logger()
        self.trainer = trainer
        trainer.build_models()
        return trainer

    def run(self) -> None:
        try:
            super().run()
            self._report_status()
        finally:
            self.session.close()

    def _report_status(self) -> None:
        """Log what the arctic server did, and keep it beside SkyRL's exports."""
        status = self.session.status()
        logger.info(f"arctic-rl served: {status['served']}")
        path = os.path.join(self.cfg.trainer.export_path, STATUS_FILE)
        with open(path, "w") as f:
            json.dump(status, f, indent=2, default=str)


@ray.remote(num_cpus=1)
def arctic_entrypoint(cfg) -> None:
    ArcticRLExp(cfg).run()


def parse_config(argv: list[str]):
    """SkyRL's config with ``trainer.arctic_rl``, validated by SkyRL and by the arctic backend."""
    cfg = ArcticSkyRLTrainConfig.from_cli_overrides([arg for arg in argv if not arg.startswith(OVERRIDE_FLAG)])
    validate_cfg(cfg)
    check_supported(cfg)
    placement(cfg)
    return cfg


def main() -> None:
    cfg = parse_config(sys.argv[1:])
    arctic = cfg.trainer.arctic_rl
    # Start (or join) Ray here, with enough CPU stand-ins for the jobs where there is no CUDA; the
    # arctic server the run starts inside the task lands in this same cluster.
    connect_ray(arctic.ray_auto_attach, cpu_gpus=max(1, placement(cfg).cluster_gpus))
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    sync_registries()
    env_vars = prepare_runtime_environment(cfg)
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)})
    ray.get(arctic_entrypoint.options(runtime_env={"env_vars": env_vars}).remote(cfg))


if __name__ == "__main__":
    main()
