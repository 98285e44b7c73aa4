"""One rank of a DeepSpeed engine, as a Ray actor: the training engine, or forward-only for log-probs.

The engine does not know GRPO from SFT: ``fwd_bwd`` runs the model where the
loss needs it, applies the named loss from the processor registry, and returns
metric sums for the job to reduce across ranks.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from arctic_rl_core.config import TrainingConfig
from arctic_rl_core.engines.batching import RowBatch, micro_batch_rows, micro_batches
from arctic_rl_core.engines.runtime import configure_process, device_memory, empty_device_cache, free_port
from arctic_rl_core.engines.token_outputs import TokenOutputs, token_outputs
from arctic_rl_core.engines.training.deepspeed_setup import build_ds_config, build_optimizer, lr_multiplier
from arctic_rl_core.engines.training.offload import LP, NON_LP, EngineOffload
from arctic_rl_core.errors import EngineAsleep
from arctic_rl_core.models.forward import decoder_body
from arctic_rl_core.models.layer_graphs import release_layer_graphs

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a DeepSpeed rank needs; built by the job from the validated client config."""

    model_name: str
    device: str  # "cuda" | "cpu"
    trainable: bool
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ds_config: dict = field(default_factory=dict)
    checkpoint_path: str | None = None
    seed: int = 42
    full_determinism: bool = False
    allowed_loss_prefixes: tuple[str, ...] = ()
    threads: int | None = None
    weight_sync_bucket_size: int = 256 * 1024 * 1024
    # Split placement: the user's WeightSyncConfig fields; syncs then go through the WeightSyncCoordinator.
    split_weight_sync: dict | None = None


@dataclass
class LossCall:
    """A validated loss: registry name, parsed config dict, post-processors, and the call's denominators."""

    loss_fn: str
    config: dict
    post: list
    global_tokens: float
    global_seqs: float
    horizon: int


class DeepSpeedWorker:
    """Built in two steps: the job asks rank 0 for a rendezvous address, then every rank runs ``setup``."""

    def __init__(self, rank: int, world_size: int, spec: WorkerSpec):
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.device = configure_process(spec.device, spec.threads)
        self.engine = None
        self._ipc = self._ipc_session = None
        self._coordinator = None  # split placement's weight-sync group, from the first sync on

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> dict:
        spec = self.spec
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )  # fmt: skip
        import deepspeed
        from transformers import AutoModelForCausalLM, enable_full_determinism, set_seed

        if spec.full_determinism:
            enable_full_determinism(spec.seed)
        else:
            set_seed(spec.seed)
        deepspeed.init_distributed(dist_backend="nccl" if spec.device == "cuda" else "gloo", auto_mpi_discovery=False)

        training = spec.training
        model = AutoModelForCausalLM.from_pretrained(
            spec.model_name, dtype=torch.float32, attn_implementation=training.attn_impl
        )
        if spec.trainable and training.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        ds_config = build_ds_config(spec.ds_config, training if spec.trainable else None, training.dtype)
        self._zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        optimizer = scheduler = None
        if spec.trainable and "optimizer" not in ds_config:
            optimizer = build_optimizer(model.named_parameters(), training.optimizer, spec.device)
            if "scheduler" not in ds_config:
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(training.optimizer))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
            model_parameters=model.parameters() if spec.trainable and optimizer is None else None,
        )  # fmt: skip
        if not spec.trainable:
            self.engine.eval()
        _undo_optimizer_warm_step(self.engine.optimizer)
        self._pending_micro_batches = 0  # real micro-batches whose gradients wait for step()
        self._pending_backwards = 0  # backward passes, dummy ones included
        self._offload = EngineOffload(self.engine, self._zero_stage, self.device)
        self._offload.settle(LP)  # a memory home of their own, so sleeping gives all of it back
        if spec.checkpoint_path:
            self._resume(Path(spec.checkpoint_path))
        return self.info()

    def _resume(self, root: Path) -> None:
        """Load the checkpoint ``root/latest`` names; a new or empty ``root`` starts from the base weights.

        A directory that cannot be what the user meant is refused, naming the one to use:
        ``save_checkpoint`` returns ``root/global_stepN``, and resuming from that would
        otherwise start over without a word.
        """
        field = "checkpoint_path"
        if not (root / "latest").is_file():
            if (root.parent / "latest").is_file():
                raise ValueError(
                    f"{field}={str(root)!r} is one checkpoint inside {str(root.parent)!r}: set {field} to "
                    f"{str(root.parent)!r}, whose 'latest' file names the step to resume from"
                )
            if root.is_dir() and any(root.glob("global_step*")):
                raise ValueError(f"{field}={str(root)!r} holds checkpoints but no 'latest' file naming one")
            logger.info("no checkpoint in %s yet: training starts from the base weights", root)
            return
        tag = (root / "latest").read_text().strip()
        loaded, _ = self.engine.load_checkpoint(str(root), load_module_strict=True)
        if loaded is None:
            raise ValueError(f"{field}={str(root)!r}: 'latest' names {tag!r}, which is not a loadable checkpoint")
        _load_rng_state(root / tag / f"rng_state_rank{self.rank}.pt")
        logger.info("resumed from %s at step %d", root / tag, self.engine.global_steps)

    # ------------------------------------------------------------ identity

    def info(self) -> dict:
        return {
            "rank": self.rank, "pid": os.getpid(), "device": str(self.device), "zero_stage": self._zero_stage,
            # The job checks batches against these before any rank sees them.
            "vocab_size": self.model.get_input_embeddings().num_embeddings,
            "max_positions": getattr(self.model.config, "max_position_embeddings", None),
        }  # fmt: skip

    def watch(self) -> None:
        """Blocks forever; the job awaits it so a dead worker is noticed at once, even when idle."""
        import threading

        threading.Event().wait()

    # ------------------------------------------------------------ forward passes

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    def _outputs(self, batch: RowBatch, select: torch.Tensor, post: list, entropy: str, top_k: int = 0) -> TokenOutputs:
        from arctic_rl_core.processors import resolve_post

        return token_outputs(
            self.model,
            batch.input_ids,
            batch.attention_mask,
            select,
            post=resolve_post(post),
            entropy=entropy,
            zorro=self.spec.training.zorro_train,
            top_k=top_k,
            cuda_graphs=self.spec.training.cuda_graphs,
            agree_chunks=self._head_chunks,
        )

    def fwd_bwd(self, batch: RowBatch, call: LossCall) -> dict:
        """Forward + backward over micro-batches; gradients accumulate until ``step``."""
        from arctic_rl_core.processors import LossInputs, resolve_loss

        if not self.spec.trainable:
            raise RuntimeError("fwd_bwd on a forward-only engine")
        self._require_awake("fwd_bwd")
        spec = resolve_loss(call.loss_fn, self.spec.allowed_loss_prefixes)
        config = spec.parse_config(call.config)
        # Entropy is always reported; it carries a gradient only when the loss uses it.
        entropy_mode = "grad" if spec.needs_entropy(config) else "metric"
        mb_spec = self.spec.training.mb_spec
        parts = micro_batches(batch, mb_spec.max_tokens_per_mb, mb_spec.n_mbs or 1, mb_spec.max_rows_per_mb)
        sums: dict[str, list] = {}  # name -> [total, weight], floats or device scalars
        maxima: dict[str, list] = {}
        loss_total: float | torch.Tensor = 0.0
        self.engine.train()
        # Every rank runs as many passes as the busiest one: ZeRO-2 reduces and ZeRO-3 gathers in every pass,
        # and those collectives pair up pass by pass. A rank out of rows runs a zero loss on a dummy row.
        passes = self._most_over_ranks(max(len(parts), 1))
        for index in range(passes):
            part = parts[index] if index < len(parts) else None
            self.engine.set_gradient_accumulation_boundary(index == passes - 1)
            self._begin_pass()
            if part is None:
                loss = self._dummy_loss()
            else:
                self._pending_micro_batches += 1
                part = part.to(self.device)
                select = part.loss_mask > 0
                out = self._outputs(part, select, call.post, entropy_mode)
                result = spec(
                    LossInputs(
                        logprobs=out.logprobs,
                        mask=part.loss_mask,
                        context=part.context,
                        entropy=out.entropy,
                        global_tokens=call.global_tokens,
                        global_seqs=call.global_seqs,
                        horizon=call.horizon,
                    ),
                    config,
                )
                loss = result.loss
                # Metrics stay on the device until every backward is queued: reading one
                # here would make the host wait for the forward and leave the GPU idle
                # while the backward's kernels are issued.
                for name, (total, weight) in (*result.metrics.items(), *out.metrics.items()):
                    acc = sums.setdefault(name, [0.0, 0.0])
                    acc[0] = acc[0] + _detached(total)
                    acc[1] = acc[1] + _detached(weight)
                for name, value in result.maxima.items():
                    maxima.setdefault(name, []).append(_detached(value))
                if out.entropy is not None and "entropy" not in result.metrics:
                    acc = sums.setdefault("entropy", [0.0, 0.0])
                    acc[0] = acc[0] + (out.entropy.detach() * part.loss_mask).sum()
                    acc[1] = acc[1] + part.loss_mask.sum()
            loss_total = loss_total + loss.detach()
            # DeepSpeed averages gradients over ranks; our shares sum to the global loss.
            self.engine.backward(loss * self.world_size)
            self._pending_backwards += 1
        return {
            "loss": float(loss_total),
            "sums": {name: [float(total), float(weight)] for name, (total, weight) in sums.items()},
            "maxima": {name: max(float(v) for v in values) for name, values in maxima.items()},
            "micro_batches": len(parts),
        }

    def _dummy_loss(self) -> torch.Tensor:
        """A zero loss on a dummy row, through the modules a real pass runs: ZeRO-3 checks that ranks run the same."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        select = torch.tensor([[True, False]], device=self.device)
        out = token_outputs(self.model, ids, torch.ones_like(ids), select, agree_chunks=self._head_chunks)
        return out.logprobs.sum() * 0.0

    @property
    def _head_chunks(self) -> Callable[[int], int] | None:
        """Under ZeRO-3 each LM head call gathers the head's weight: ranks run as many chunks as the busiest."""
        return self._most_over_ranks if self._zero_stage == 3 else None

    def _begin_pass(self) -> None:
        """What ``engine.forward`` does first, which our forward (body and head, not ``engine(...)``) skips.

        It tells a ZeRO optimizer that the previous backward is over; without it, ZeRO-3 overwrites the
        gradients of the previous micro-batches with the next one's instead of adding them up.
        """
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        if isinstance(self.engine.optimizer, ZeROOptimizer):
            self.engine.optimizer.clear_backward_seen_flag()

    def _most_over_ranks(self, count: int) -> int:
        """The largest ``count`` of any rank."""
        if self.world_size == 1:
            return count
        import torch.distributed as dist

        most = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def _join_gathers(self) -> None:
        """A rank with no rows still runs a forward under ZeRO-3: the others' parameter gathers wait for it."""
        if self._zero_stage == 3:
            self._dummy_loss()

    def _forward_passes(self, batch: RowBatch) -> Iterator[tuple[tuple[slice, slice], RowBatch, torch.Tensor] | None]:
        """A forward-only call in micro-batches within ``mb_spec``'s forward bounds: (rows, columns), part, select.

        Its activations and LM-head outputs then take no more memory than those bounds allow.
        Under ZeRO-3 every pass gathers the parameters, so each rank runs as many passes as the
        busiest one: ``None`` marks a pass with no rows of this rank's, which joins the gathers.
        """
        mb_spec = self.spec.training.mb_spec
        ranges = micro_batch_rows(batch, mb_spec.forward_max_tokens, max_rows=mb_spec.forward_max_rows)
        passes = self._most_over_ranks(len(ranges)) if self._zero_stage == 3 else len(ranges)
        for index in range(passes):
            if index >= len(ranges):
                self._join_gathers()
                yield None
                continue
            rows = slice(*ranges[index])
            part = batch.select(rows.start, rows.stop)
            columns = part.used_columns()
            part = part.trimmed().to(self.device)
            mask = part.attention_mask.bool()
            select = torch.zeros_like(mask)
            select[:, :-1] = mask[:, :-1] & mask[:, 1:]
            yield (rows, columns), part, select

    @torch.no_grad()
    def token_log_probs(self, batch: RowBatch, top_k: int) -> dict:
        """Shifted log-probs [B, T] plus the top-k alternatives [B, T, k] at every scored position."""
        self._require_awake("log_probs", (LP,))
        self.engine.eval()
        rows, length = batch.input_ids.shape
        result = {"log_probs_shifted": torch.zeros(rows, length)}
        if top_k:
            result["top_ids"] = torch.zeros(rows, length, top_k, dtype=torch.long)
            result["top_log_probs"] = torch.zeros(rows, length, top_k)
        for current in self._forward_passes(batch):
            if current is None:
                continue
            window, part, select = current
            out = self._outputs(part, select, [], "none", top_k=top_k)
            result["log_probs_shifted"][window] = out.logprobs.float().cpu()
            if top_k:
                result["top_ids"][window] = out.top_ids.cpu()
                result["top_log_probs"][window] = out.top_logprobs.float().cpu()
        return result

    @torch.no_grad()
    def fwd_no_grad(self, batch: RowBatch, post: list, return_entropy: bool) -> dict:
        """Shifted log-probs [B, T] (0 where the next token is padding), optionally entropy."""
        self._require_awake("fwd_no_grad", (LP,))
        self.engine.eval()
        rows, length = batch.input_ids.shape
        log_probs = torch.zeros(rows, length, dtype=torch.float32)
        entropy = torch.zeros(rows, length, dtype=torch.float32) if return_entropy else None
        for current in self._forward_passes(batch):
            if current is None:
                continue
            window, part, select = current
            out = self._outputs(part, select, post, "metric" if return_entropy else "none")
            selected = select.cpu()
            log_probs[window] = torch.where(selected, out.logprobs.float().cpu(), 0.0)
            if entropy is not None:
                entropy[window] = torch.where(selected, out.entropy.float().cpu(), 0.0)
        result = {"log_probs_shifted": log_probs}
        if entropy is not None:
            result["entropy_shifted"] = entropy
        return result

    # ------------------------------------------------------------ optimizer

    def step(self) -> dict:
        if not self.spec.trainable:
            raise RuntimeError("step on a forward-only engine")
        self._require_awake("step")
        if self._pending_backwards == 0:
            raise ValueError("step() called with no gradients: call fwd_bwd first")
        self.engine.set_gradient_accumulation_boundary(True)
        norm = self._grad_norm_if_untracked()
        self.engine.step()
        self._offload.settle(NON_LP)  # after the first step, which created AdamW's moments; then a no-op
        applied, self._pending_micro_batches, self._pending_backwards = self._pending_micro_batches, 0, 0
        tracked = self.engine.get_global_grad_norm()
        grad_norm = float(tracked) if tracked is not None else norm
        # Gradients accumulate per job, from every client: the count says how many micro-batches this step applied.
        step = int(self.engine.global_steps)
        return {"grad_norm": grad_norm, "lr": self._lr(), "step": step, "micro_batches": applied}

    def _grad_norm_if_untracked(self) -> float:
        """ZeRO-0 does not report the global grad norm; compute it before the step clips."""
        if self._zero_stage != 0:
            return float("nan")
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0]) if self.engine.get_lr() else float("nan")

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> dict:
        """Atomic: write under a temporary tag, rename, then point ``latest`` at it."""
        self._require_awake("save_checkpoint")
        import torch.distributed as dist

        from arctic_rl_core.errors import BadRequest

        root = Path(directory)
        tag = f"global_step{self.engine.global_steps}"
        stamp = int(time.time() * 1000)
        staging, refused = (f".tmp-{tag}-{stamp}", None) if self.rank == 0 else (None, None)
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                refused = f"save_checkpoint: cannot create the directory path={directory!r}: {exc}"
        # Every rank learns the outcome: one rank raising alone would leave the others waiting in a collective.
        staging, refused = self._broadcast_object((staging, refused))
        if refused is not None:
            raise BadRequest(refused)
        self.engine.save_checkpoint(str(root), tag=staging, save_latest=False)
        # DeepSpeed keeps no RNG state; dropout after a resume must draw what the uninterrupted run would have.
        (root / staging).mkdir(exist_ok=True)
        torch.save(_rng_state(), root / staging / f"rng_state_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            final = root / tag
            if final.exists():
                # Renamed aside, not deleted in place: a crash mid-delete would leave `latest` naming a torn directory.
                retired = root / f".old-{tag}-{stamp}"
                os.replace(final, retired)
                os.replace(root / staging, final)
                shutil.rmtree(retired)
            else:
                os.replace(root / staging, final)
            pointer = root / ".latest.tmp"
            pointer.write_text(tag)
            os.replace(pointer, root / "latest")
        dist.barrier()
        return {"path": str(root / tag), "step": int(self.engine.global_steps)}

    def _broadcast_object(self, value):
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------ weights

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full parameters; under ZeRO-3 every rank must iterate in lockstep (they gather).

        While the weights sleep (ZeRO 0-2) they are read from their host copies, so a file sync still works.
        """
        import deepspeed

        if self._zero_stage == 3:
            self._require_awake("reading ZeRO-3 weights", (LP,))
        for name, param in self.model.named_parameters():
            if self._zero_stage == 3:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.data
            else:
                yield name, self._offload.host_view(param.data)

    def weight_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for _, tensor in self.named_full_parameters():
            total += tensor.detach().double().pow(2).sum().cpu()
        return float(total.sqrt())

    def export_weights(self, directory: str) -> dict:
        """Write full HF-named weights as safetensors (rank 0); all ranks gather under ZeRO-3."""
        from arctic_rl_core.weight_sync.file_sync import write_weights

        if self.rank != 0:
            for _ in self.named_full_parameters():  # ZeRO-3: join every gather
                pass
            return {}
        # Copies: a gathered ZeRO-3 parameter is released when its gather context ends.
        named = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in self.named_full_parameters()]
        write_weights(named, directory)
        return {"bytes": sum(t.nbytes for _, t in named), "tensors": len(named)}

    # -- CUDA IPC: the colocated sampler maps our buckets (our flat ZeRO-1/2 parameter buffers themselves,
    # or packed copies). An IPC session keeps plan, buffers and handles for later syncs until ipc_close,
    # which sleep calls.

    # -- Split placement: the WeightSyncCoordinator (NCCL on GPU, gloo on CPU) to the sampling replicas.

    def coordinator_send(self, group: tuple[dict, str] | None) -> dict:
        """This rank's part of a sync: whole parameters, or under ZeRO-3 its flat partitions (the group gathers).

        ``group`` (config, rendezvous address) first joins a new weight-sync
        group; every member joins at once, this being its rendezvous.
        """
        from arctic_rl_core.config import WeightSyncConfig
        from arctic_rl_core.weight_sync import FlatShard, TrainingRank, WeightSyncCoordinator

        self._require_awake("sync_weights", (LP,))
        if group is not None:
            self.coordinator_close()
            config, master_addr = group
            self._coordinator = WeightSyncCoordinator(
                WeightSyncConfig(**config), TrainingRank(self.rank), master_addr=master_addr, device=self.device
            )
        if self._coordinator is None:
            raise RuntimeError("coordinator_send without a weight-sync group")
        params = self.model.named_parameters()
        if self._zero_stage == 3:
            weights = [(name, FlatShard(p.ds_tensor.data, p.ds_shape)) for name, p in params]
        else:
            weights = [(name, p.data) for name, p in params]
        self._coordinator.send(weights)
        return {"rank": self.rank, "tensors": len(weights)}

    def coordinator_close(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()
        self._coordinator = None

    def ipc_open(self, bucket_size: int, low_memory: bool) -> int:
        """Plan flattened buckets over the (unchanged, on-GPU) parameters; return how many."""
        self._require_awake("sync_weights(cuda_ipc=True)", (LP,))
        from arctic_rl_core.weight_sync.cuda_ipc import CudaIpcSender, IpcSession

        if self._zero_stage == 3:
            raise ValueError(
                "sync_weights(cuda_ipc=True) needs whole parameters on each GPU; under ZeRO-3 use cuda_ipc=False"
            )
        if self._ipc_session is None:
            self._ipc_session = IpcSession(self.device)
        named = ((name, p.data) for name, p in self.model.named_parameters())
        self._ipc = CudaIpcSender(named, bucket_size, session=self._ipc_session, low_memory=low_memory)
        return len(self._ipc)

    def ipc_share(self, index: int | None) -> list:
        """Handles to bucket ``index`` (packed now), or to all of them."""
        return self._ipc.share_all() if index is None else [self._ipc.share(index)]

    def ipc_release(self, index: int | None) -> None:
        if self._ipc is None:
            return
        self._ipc.release(index)
        if index is None:
            self._ipc = None

    def ipc_close(self) -> dict:
        """End the IPC session and free its buffers (the sampler has forgotten its mappings of them)."""
        self._ipc = None
        if self._ipc_session is None:
            return {"rank": self.rank, "freed_bytes": 0}
        freed = self._ipc_session.nbytes
        self._ipc_session.close()
        self._ipc_session = None
        return {"rank": self.rank, "freed_bytes": freed}

    # ------------------------------------------------------------ memory

    def sleep(self, mode: str) -> dict:
        """Move state to host memory; modes stack (``non_lp`` then ``lp_params`` is ``all``). On CPU: nothing."""
        if self.device.type != "cuda":
            return {"rank": self.rank, "mode": mode, "moved": [], "reason": "device is cpu: nothing to offload"}
        before = device_memory()
        self.ipc_close()
        release_layer_graphs(decoder_body(self.model))  # their pools hold a step's activations
        moved = self._offload.sleep(mode)
        empty_device_cache()
        return {
            "rank": self.rank, "mode": mode, "moved": sorted(moved), "freed_bytes": before - device_memory(),
            # What PyTorch still holds on the device for this process (asleep in "all": next to nothing).
            "reserved_bytes": device_memory(reserved=True),
        }  # fmt: skip

    def wake(self) -> dict:
        if self.device.type != "cuda" or not self._offload.asleep:
            return {"rank": self.rank, "woke": False}
        before = device_memory()
        states = self._offload.wake()
        return {"rank": self.rank, "woke": True, "states": states, "allocated_bytes": device_memory() - before}

    def _require_awake(self, call: str, parts: tuple[str, ...] = (LP, NON_LP)) -> None:
        asleep = sorted(self._offload.asleep.intersection(parts))  # empty on CPU: sleep moves nothing there
        if asleep:
            wake = "wake_training" if self.spec.trainable else "wake_log_prob"
            raise EngineAsleep(f"{call}: {' and '.join(asleep)} asleep on the device; call {wake}() first")

    def empty_cache(self) -> dict:
        before = device_memory(reserved=True)
        empty_device_cache()
        return {"rank": self.rank, "released_bytes": before - device_memory(reserved=True)}

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _detached(value):
    """A metric term as it is: a float stays one, a tensor leaves the graph and stays on its device."""
    return value.detach() if isinstance(value, torch.Tensor) else value


def _undo_optimizer_warm_step(optimizer) -> None:
    """Undo the step DeepSpeed's ZeRO-0 fp16/bf16 wrappers take when they are built.

    They create the optimizer's state by stepping it once with zero gradients: Adam's
    step count then starts at 1 (every bias correction is off by one) and weight
    decay shrinks the fp32 master weights before any training. ZeRO 1-3 do not.
    The masters are copies of the model's 16-bit weights, so copying those back is exact.
    """
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return
    optimizer.optimizer.state.clear()
    with torch.no_grad():
        if isinstance(optimizer, FP16_Optimizer):
            for low, master in zip(optimizer.fp16_groups_flat, optimizer.fp32_groups_flat):
                master.copy_(low.float())
        else:
            for low_group, master_group in zip(optimizer.fp16_groups, optimizer.fp32_groups):
                for low, master in zip(low_group, master_group):
                    master.copy_(low.float())


def _rng_state() -> dict:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _load_rng_state(path: Path) -> None:
    """Restore a rank's RNG state saved with its checkpoint (checkpoints written before it have none)."""
    import random

    import numpy as np

    if not path.is_file():
        return
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
