"""``ArcticDispatch``: what SkyRL's trainer asks of its ``WorkerDispatch``, served by the arctic-rl client.

SkyRL's ``RayPPOTrainer`` drives training through ``self.dispatch``: forward
passes for old and reference log-probs, ``forward_backward`` and ``optim_step``
per mini-batch, weight sync, checkpoints. Here each becomes one arctic call:

==========================================  ============================================
WorkerDispatch                              arctic-rl client
==========================================  ============================================
forward("policy" / "ref", batch)            fwd_no_grad(reference_model=False / True)
forward_backward("policy", mini-batch)      fwd_bwd(batch, processing=LossPlan)
optim_step("policy")                        step()
save_weights_for_sampler()                  sync_weights() (colocated: sleep/wake around it)
save_checkpoint("policy", dir)              save_checkpoint(path=dir)
load_checkpoint("policy", dir)              the training job was started from dir
==========================================  ============================================

arctic shards rows across its own data-parallel ranks, so SkyRL sees one
rank and stages mini-batches as plain slices.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import ray
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

from arctic_rl_skyrl.algorithm import LossPlan
from arctic_rl_skyrl.batch import from_shifted, model_batch, training_context
from arctic_rl_skyrl.session import ArcticSession

logger = logging.getLogger(__name__)

POLICY, REF = "policy", "ref"

# arctic metric -> SkyRL's name for it (the rest keep arctic's names under loss_metrics/).
_METRIC_NAMES = {"pg_loss": "policy_loss", "kl": "policy_kl", "entropy": "policy_entropy"}


class ArcticDispatch:
    """The WorkerDispatch surface ``RayPPOTrainer`` uses, for one policy (and its reference) in arctic-rl."""

    def __init__(
        self,
        session: ArcticSession,
        plan: LossPlan,
        colocated: bool,
        cuda_ipc: bool = False,
        resumed_from: Optional[str] = None,
    ):
        self.session = session
        self.plan = plan
        self.colocated = colocated
        self.cuda_ipc = cuda_ipc
        self.resumed_from = resumed_from
        self._training_asleep = False
        self.last_weight_sync_seconds: Optional[float] = None

    # ------------------------------------------------------------ layout

    def get_lcm_dp_size(self) -> int:
        """arctic splits each call across its training ranks itself; any batch size works."""
        return 1

    def stage_data(
        self, model: str, data: TrainingInputBatch, mini_batch_boundaries: list[tuple[int, int]]
    ) -> list[TrainingInputBatch]:
        """Mini-batches as slices; the arctic call serializes each when it is sent."""
        return [data[start:end] for start, end in mini_batch_boundaries]

    # ------------------------------------------------------------ forward passes

    def forward(self, model: str, data: TrainingInputBatch, **_worker_kwargs: Any) -> WorkerOutput:
        """Log-probs of the response tokens: the policy from the training engine, the reference from the log-prob engine."""
        if model not in (POLICY, REF):
            raise ValueError(f"the arctic-rl backend serves the policy and its reference, not {model!r}")
        self._wake_training()
        response_length = data.metadata["response_length"]
        batch = model_batch(data, {})
        # The policy's log-probs at the sampling temperature; the reference's at 1.0, as SkyRL's RefWorker.
        processing = self.plan.forward_processing(reference=model == REF)
        result = self.session.call(
            lambda client: client.fwd_no_grad(batch=batch, reference_model=model == REF, processing=processing)
        )
        log_probs = from_shifted(result["log_probs_shifted"], response_length)
        return WorkerOutput(loss_fn_outputs=[{"logprobs": row.tolist()} for row in log_probs], metrics={})

    def forward_from_staged(self, model: str, chunk: TrainingInputBatch, **worker_kwargs: Any) -> WorkerOutput:
        return self.forward(model, chunk, **worker_kwargs)

    # ------------------------------------------------------------ training

    def forward_backward(self, model: str, data: TrainingInputBatch, **_worker_kwargs: Any) -> WorkerOutput:
        """One policy mini-batch through arctic's loss; gradients accumulate until ``optim_step``."""
        if model != POLICY:
            raise ValueError(f"the arctic-rl backend trains the policy only, not {model!r}")
        self._wake_training()
        context = training_context(data, self.plan.reference, self.plan.rollout_correction)
        batch = model_batch(data, context, horizon=self.plan.horizon)
        processing = self.plan.processing(rows=len(batch["args"][0]))
        result = self.session.call(lambda client: client.fwd_bwd(batch=batch, processing=processing))
        metrics = {"final_loss": float(result["loss"]), "response_length": int(data.metadata["response_length"])}
        for name, value in result["metrics"].items():
            metrics[_METRIC_NAMES.get(name, f"loss_metrics/{name}")] = float(value)
        return WorkerOutput(metrics=metrics)

    def forward_backward_from_staged(self, model: str, chunk: TrainingInputBatch, **worker_kwargs: Any) -> WorkerOutput:
        return self.forward_backward(model, chunk, **worker_kwargs)

    def optim_step(self, model: str) -> Optional[float]:
        if model != POLICY:
            raise ValueError(f"the arctic-rl backend steps the policy only, not {model!r}")
        result = self.session.call(lambda client: client.step())
        return float(result["grad_norm"])

    # ------------------------------------------------------------ weights and memory

    def init_weight_sync_state(self, inference_engine_client: Any) -> None:
        """Nothing to set up: arctic wires the training and sampling jobs together when it creates them."""

    async def save_weights_for_sampler(self) -> None:
        """Training weights into the sampler (which resets its prefix cache); colocated, hand the devices over."""
        if self.colocated:
            await self.session.acall(lambda client: client.sleep_training(mode="non_lp" if self.cuda_ipc else "all"))
            self._training_asleep = True
            await self.session.acall(lambda client: client.wake_inference(tags=["weights"]))
        result = await self.session.acall(lambda client: client.sync_weights(cuda_ipc=self.cuda_ipc))
        self.last_weight_sync_seconds = float(result.get("seconds", 0.0))
        if self.colocated:
            if self.cuda_ipc:
                await self.session.acall(lambda client: client.sleep_training(mode="lp_params"))
            await self.session.acall(lambda client: client.wake_inference(tags=["kv_cache"]))

    def _wake_training(self) -> None:
        if self._training_asleep:
            self.session.call(lambda client: client.wake_training())
            self._training_asleep = False

    def get_timing_metrics(self) -> dict[str, float]:
        if self.last_weight_sync_seconds is None:
            return {}
        return {"weight_sync_transfer": self.last_weight_sync_seconds}

    def empty_cache(self, model: Optional[str] = None) -> None:
        """Colocated, release the training engine's cached device memory for the sampler; split, nothing to do."""
        if self.colocated and not self._training_asleep:
            self.session.call(lambda client: client.empty_training_cache())

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, model: str, ckpt_dir: str, tokenizer: Any = None) -> None:
        """A DeepSpeed checkpoint (weights, optimizer, scheduler) of the training job, written atomically."""
        if model != POLICY:
            raise ValueError(f"the arctic-rl backend checkpoints the policy only, not {model!r}")
        self._wake_training()
        result = self.session.call(lambda client: client.save_checkpoint(path=ckpt_dir))
        logger.info("arctic-rl checkpoint saved: %s", result.get("path", ckpt_dir))

    def finalize_pending_saves(self, model: str) -> None:
        """arctic writes checkpoints synchronously: nothing is pending when save_checkpoint returns."""

    def load_checkpoint(self, model: str, ckpt_dir: str, **_options: Any) -> None:
        """arctic loads a checkpoint when its training job starts; check the job started from this one."""
        if model != POLICY:
            raise ValueError(f"the arctic-rl backend checkpoints the policy only, not {model!r}")
        if self.resumed_from is None or os.path.realpath(self.resumed_from) != os.path.realpath(ckpt_dir):
            raise RuntimeError(
                f"SkyRL resumes from {ckpt_dir}, but the arctic training job was started from "
                f"{self.resumed_from or 'the base model'}; the trainer must resolve the checkpoint before build_models()"
            )

    def get_node_ids(self) -> list[str]:
        """Nodes to clean old checkpoints on: this one (arctic's rank 0 writes them to a path shared with it)."""
        return [ray.get_runtime_context().get_node_id()]
