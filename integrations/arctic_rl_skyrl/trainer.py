"""``ArcticPPOTrainer``: SkyRL's PPO loop, unchanged, with its models in arctic-rl.

``RayPPOTrainer`` keeps everything it owns: the dataloader, generation and
rewards, advantages, dynamic sampling, metrics, evaluation, checkpoint
bookkeeping. ``build_models`` starts the arctic jobs instead of FSDP workers
and installs an :class:`ArcticDispatch`; advantages reach arctic unscaled,
because arctic's loss aggregates by ``loss_agg_mode`` itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from loguru import logger
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.trainer import RayPPOTrainer

from arctic_rl_skyrl.algorithm import LossPlan
from arctic_rl_skyrl.config import client_config, needs_reference, optimizer_steps, placement
from arctic_rl_skyrl.dispatch import POLICY, REF, ArcticDispatch
from arctic_rl_skyrl.session import ArcticSession

LATEST_CHECKPOINT_FILE = "latest_ckpt_global_step.txt"


@dataclass(frozen=True)
class ArcticModel:
    """A SkyRL model role served by an arctic job: the policy by the training job, the reference by the log-prob job."""

    role: str
    job: str


class ArcticPPOTrainer(RayPPOTrainer):
    def __init__(self, *args, session: ArcticSession, plan: LossPlan, **kwargs):
        super().__init__(*args, **kwargs)
        self.session = session
        self.plan = plan
        # SkyRL sleeps the sampler after each rollout when the engines share devices; arctic decides that.
        self.colocate_all = placement(self.cfg).colocate
        # The scraper reads SkyRL's vLLM servers' /metrics; arctic runs none (its server reports `status`).
        self._vllm_metrics_scraper = None

    def build_models(self, *worker_classes) -> None:
        """Start the arctic jobs (resuming a checkpoint if SkyRL will) and route the dispatch to them.

        ``worker_classes`` (SkyRL's FSDP/Megatron workers) are not used: arctic's engines replace them.
        """
        resume_dir = policy_checkpoint_to_resume(self.cfg)
        total_steps = optimizer_steps(self.cfg, self.total_training_steps or 1)
        self.session.start(client_config(self.cfg, total_steps, checkpoint_path=resume_dir))
        self.policy_model = ArcticModel(POLICY, "training")
        self.ref_model = ArcticModel(REF, "log_prob") if needs_reference(self.cfg) else None
        self.critic_model = None
        self.dispatch = ArcticDispatch(
            self.session,
            self.plan,
            colocated=self.colocate_all,
            cuda_ipc=self.cfg.trainer.arctic_rl.cuda_ipc_weight_sync,
            resumed_from=resume_dir,
        )
        logger.info(f"arctic-rl serves the policy{' and its reference' if self.ref_model else ''}; loss {self.plan}")

    def _normalize_advantages(
        self,
        data: TrainingInputBatch,
        mini_batch_boundaries: list[tuple[int, int]],
        prompt_boundaries: Optional[list[tuple[int, int]]] = None,
    ) -> TrainingInputBatch:
        """Only SkyRL's optional z-score: the loss reduction is arctic's ``loss_agg_mode``, not pre-scaled advantages."""
        if self.cfg.trainer.algorithm.advantage_batch_normalize:
            advantages, mask = data["advantages"], data["response_mask"]
            mean = advantages.mean()
            variance = ((advantages - mean).pow(2) * mask).sum() / mask.sum().clamp(min=1)
            data["advantages"] = (advantages - mean) * variance.clamp(min=1e-8).rsqrt()
        return data


def policy_checkpoint_to_resume(cfg) -> Optional[str]:
    """The policy checkpoint SkyRL's ``load_checkpoints`` will resume from, found the same way; None: none."""
    trainer = cfg.trainer
    mode = trainer.resume_mode
    if mode in (None, "none"):
        return None
    if mode == "from_path":
        if not trainer.resume_path:
            raise ValueError("trainer.resume_path must be set when trainer.resume_mode=from_path")
        return os.path.join(trainer.resume_path, "policy")
    latest = os.path.join(trainer.ckpt_path, LATEST_CHECKPOINT_FILE)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        step = int(f.read().strip())
    return os.path.join(trainer.ckpt_path, f"global_step_{step}", "policy")
