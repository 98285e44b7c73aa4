"""``actor_rollout_ref.actor.strategy=arctic``: a verl training engine whose compute runs in arctic-rl.

verl's TrainingWorker keeps its loop (mini-batches, epochs, metrics); each
engine call becomes one arctic-rl operation:

=====================================  ==========================================================
verl engine call                       arctic-rl
=====================================  ==========================================================
initialize (actor)                     create the server and its jobs (``ArcticSession.start``)
forward_backward_batch                 ``fwd_bwd`` with the ``grpo`` processor (config mapped at
                                       startup from verl's actor settings), one call per mini-batch
optimizer_step                         ``step`` (it also zeroes the gradients and advances the LR)
infer_batch (actor: old log-probs)     ``fwd_no_grad(reference_model=False)``
infer_batch (ref)                      ``fwd_no_grad(reference_model=True)``: the log-prob engine
save_checkpoint                        ``save_checkpoint``
get_per_tensor_param                   nothing: weights stay in arctic-rl; the arctic rollout's
                                       ``update_weights`` is ``sync_weights``
=====================================  ==========================================================

The engine runs in verl's single client process (``trainer.n_gpus_per_node=1``);
data parallelism, micro-batching and the optimizer live in arctic-rl.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.base import BaseEngineCtx

from arctic_rl_verl.batch import SequenceLayout, loss_batch, post_processing, scalar_temperature
from arctic_rl_verl.config import ArcticEngineConfig
from arctic_rl_verl.mapping import ARCTIC, client_config
from arctic_rl_verl.session import ArcticSession

# arctic-rl metric -> verl's name, where both are computed the same way.
VERL_METRIC_NAMES = {
    "pg_loss": "actor/pg_loss",
    "clip_frac": "actor/pg_clipfrac",
    "dual_clip_frac": "actor/pg_clipfrac_lower",
}
# verl reduces a metric across mini-batches by max when its name contains "max": a counter then reads its last value.
SERVED_METRIC = "arctic/served_max/{op}"
SERVED_OPS = ("generate", "fwd_bwd", "step", "fwd_no_grad", "sync_weights")


@EngineRegistry.register(model_type="language_model", backend="arctic", device=["cuda", "cpu"])
class ArcticEngine(BaseEngine):
    """verl's actor or reference engine, served by an arctic-rl deployment."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if not isinstance(engine_config, ArcticEngineConfig):
            raise ValueError(
                f"strategy=arctic got a {type(engine_config).__name__}: select the arctic config group "
                "(hydra.searchpath=[pkg://arctic_rl_verl.conf] model_engine=arctic)"
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode = None
        self._lr: Optional[float] = None

    # ------------------------------------------------------------ lifecycle

    @property
    def is_reference(self) -> bool:
        return self.engine_config.forward_only

    @property
    def session(self) -> ArcticSession:
        return ArcticSession.current()

    def initialize(self):
        """The actor starts the arctic deployment; the reference (built first by verl) uses it once it exists."""
        if not self.is_reference:
            config = client_config(self.engine_config, self.model_config, self.optimizer_config)
            ArcticSession.start(config, self.engine_config.generate_batch_window_s)

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """No state of this engine lives on verl's device; arctic-rl places its own."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)

    # ------------------------------------------------------------ parallelism (verl's side is one process)

    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank()

    def get_data_parallel_size(self) -> int:
        return torch.distributed.get_world_size()

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    # ------------------------------------------------------------ compute

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        layout = SequenceLayout.of(data)
        post = post_processing(scalar_temperature(data))
        if forward_only:
            return self._log_probs(data, layout, post, loss_function)
        if self.is_reference:
            raise RuntimeError("the arctic reference engine is forward-only; verl asked it to train")
        processing = {"loss_fn": "grpo", "config": self.engine_config.loss_config, "post": post}
        batch = loss_batch(data, layout, self.engine_config.decoupled_ppo)
        result = self.session.run(self.session.client.fwd_bwd(batch, processing))
        # verl's engines return one value per micro-batch; arctic-rl's are already reduced over the call.
        metrics = {VERL_METRIC_NAMES.get(name, f"arctic/{name}"): [value] for name, value in result["metrics"].items()}
        metrics["arctic/micro_batches"] = [result["micro_batches"]]
        return {"model_output": {}, "loss": [result["loss"]], "metrics": metrics}

    def _log_probs(self, data: TensorDict, layout: SequenceLayout, post: list, loss_function) -> dict:
        if loss_function is not None:
            raise ValueError(
                "the arctic engine computes no loss in a forward-only call; verl asked with compute_loss=True"
            )
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        result = self.session.run(
            self.session.client.fwd_no_grad(
                layout.model_inputs(data),
                reference_model=self.is_reference,
                processing={"post": post},
                return_entropy=entropy,
            )
        )
        output = {"log_probs": layout.full_rows(result["log_probs_shifted"])}
        if entropy:
            output["entropy"] = layout.full_rows(result["entropy_shifted"])
        return {"model_output": output, "loss": [], "metrics": {}}

    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        outputs = super().train_batch(data, loss_function)
        served = self.session.served()
        outputs["metrics"].update({SERVED_METRIC.format(op=op): [served.get(op, 0)] for op in SERVED_OPS})
        return outputs

    def optimizer_zero_grad(self):
        """Nothing to do: arctic-rl's ``step`` leaves the gradients zeroed."""

    def optimizer_step(self) -> float:
        """arctic-rl's ``step``: clip, step, advance the schedule; verl logs the grad norm it returns."""
        result = self.session.run(self.session.client.step())
        self._lr = result["lr"]
        return float(result["grad_norm"])

    def lr_scheduler_step(self) -> Optional[float]:
        """arctic-rl advanced its schedule in ``step``: report its learning rate."""
        return self._lr

    # ------------------------------------------------------------ weights and checkpoints

    def get_per_tensor_param(self, **kwargs):
        """No tensors: the weights never leave arctic-rl (``ArcticRollout.update_weights`` syncs them there)."""
        return iter(()), None

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: Optional[str] = None,
        global_step: int = 0,
        max_ckpt_to_keep: Optional[int] = None,
        **kwargs,
    ) -> None:
        if hdfs_path is not None:
            raise ValueError(
                f"trainer.default_hdfs_dir={hdfs_path!r}: the arctic engine saves to local paths only (null)"
            )
        self.session.run(self.session.client.save_checkpoint(path=local_path))

    def load_checkpoint(
        self, local_path: str, hdfs_path: Optional[str] = None, del_local_after_load: bool = True, **kwargs
    ):
        # verl's local_path is <trainer.default_local_dir>/global_step_<N>/actor: the directory save_checkpoint
        # wrote DeepSpeed's 'latest' into, the one arctic's training worker resumes from (not global_stepN inside).
        raise NotImplementedError(
            f"verl asked to resume from {local_path!r} after arctic-rl's jobs started; arctic-rl resumes when its "
            f"training job starts: set {ARCTIC}.checkpoint_path={local_path!r} (the directory holding 'latest', "
            "not the global_step directory inside it) and trainer.resume_mode=disable"
        )
