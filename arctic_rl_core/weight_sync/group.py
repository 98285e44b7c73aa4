"""The weight-sync process group: its own rendezvous and backends, every wait bounded, every failure named.

Training ranks already belong to DeepSpeed's default group and inference
workers to their engine's, and a process has one default group. So the
coordinator builds its groups directly on a ``TCPStore`` (the rendezvous, on
``base_port``, hosted by group rank 0): the same c10d backends
(NCCL on CUDA, gloo on CPU), used through their own methods rather than the
``torch.distributed`` globals. The store also carries the small control
messages of a sync (manifest, verdicts).

Each wait is bounded by ``timeout_s`` and raises ``WeightSyncError`` naming
the step, so a dead or stuck peer is an error, never a hang.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from arctic_rl_core.weight_sync.errors import WeightSyncError

# NCCL's watchdog tears the process down when it fires; our own waits must fire first and name the step.
_NCCL_WATCHDOG_FACTOR = 2.0


@dataclass
class Pending:
    """A launched transfer; ``wait`` finishes it or raises naming its step."""

    work: Any
    step: str
    timeout: timedelta
    on_failure: Callable[[str], None]
    # Kept alive until the transfer is done: the backend reads and writes them asynchronously.
    tensors: tuple[torch.Tensor, ...]

    def wait(self) -> None:
        try:
            self.work.wait(self.timeout)
        except RuntimeError as e:
            self.on_failure(self.step)
            raise WeightSyncError(self.step, f"{e} (timeout {self.timeout.total_seconds()} s)") from e
        self.tensors = ()


class SyncGroup:
    """Rank ``rank`` of ``world_size`` members that rendezvous at ``master_addr:port``."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        port: int,
        device: torch.device,
        timeout_s: float,
        describe: Callable[[int], str],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.describe = describe
        self.failed_step: str | None = None
        self._backends: list[Any] = []
        where = f"{master_addr}:{port} (hosted by {describe(0)})"
        try:
            self.store = TCPStore(
                master_addr, port, world_size, is_master=rank == 0, timeout=self.timeout, wait_for_workers=True
            )
        except RuntimeError as e:
            raise WeightSyncError(
                "rendezvous", f"{world_size} members did not all meet at {where} within {timeout_s} s: {e}"
            ) from e
        self.where = where
        self.world = self.backend("all", rank, world_size)

    def backend(self, name: str, rank: int, size: int) -> Any:
        """A c10d backend over ``size`` members of this group, namespaced by ``name`` in the store."""
        store = PrefixStore(f"weight_sync/{name}", self.store)
        try:
            if self.device.type == "cuda":
                from torch.distributed import ProcessGroupNCCL

                options = ProcessGroupNCCL.Options()
                options._timeout = self.timeout * _NCCL_WATCHDOG_FACTOR
                options.group_name = f"arctic_weight_sync_{name}"
                backend = ProcessGroupNCCL(store, rank, size, options)
            else:
                backend = ProcessGroupGloo(store, rank, size, timeout=self.timeout)
        except RuntimeError as e:
            raise WeightSyncError(f"connect {name}", f"could not connect {size} members: {e}") from e
        self._backends.append(backend)
        return backend

    def _fail(self, step: str) -> None:
        """Remember the first failed step; NCCL kernels waiting on a dead peer only end when aborted."""
        if self.failed_step is None:
            self.failed_step = step
        if self.device.type == "cuda":
            for backend in self._backends:
                backend.abort()

    def _launch(self, step: str, launch: Callable[[], Any], tensors: tuple[torch.Tensor, ...]) -> Pending:
        try:
            work = launch()
        except RuntimeError as e:
            self._fail(step)
            raise WeightSyncError(step, str(e)) from e
        return Pending(work, step, self.timeout, self._fail, tensors)

    def send(self, backend: Any, tensor: torch.Tensor, dst: int, tag: int, step: str) -> Pending:
        return self._launch(step, lambda: backend.send([tensor], dst, tag), (tensor,))

    def recv(self, backend: Any, tensor: torch.Tensor, src: int, tag: int, step: str) -> Pending:
        return self._launch(step, lambda: backend.recv([tensor], src, tag), (tensor,))

    def all_gather(self, backend: Any, output: torch.Tensor, local: torch.Tensor, step: str) -> Pending:
        """``output`` (size x ``local``) gets every member's ``local``, in rank order."""
        # _allgather_base is what torch.distributed.all_gather_into_tensor calls: no per-rank output list.
        return self._launch(step, lambda: backend._allgather_base(output, local), (output, local))

    def publish(self, key: str, value: Any, step: str) -> None:
        try:
            self.store.set(key, pickle.dumps(value))
        except RuntimeError as e:
            self._fail(step)
            raise WeightSyncError(step, f"lost the rendezvous store at {self.where}: {e}") from e

    def collect(self, keys: Sequence[str], owners: Sequence[int], step: str) -> list[Any]:
        """The values published under ``keys`` by group ranks ``owners``, waiting at most the timeout."""
        try:
            self.store.wait(list(keys), self.timeout)
            return [pickle.loads(v) for v in self.store.multi_get(list(keys))]
        except RuntimeError as e:
            self._fail(step)
            raise WeightSyncError(step, self._silent(keys, owners, e)) from e

    def _silent(self, keys: Sequence[str], owners: Sequence[int], error: RuntimeError) -> str:
        """Name the members that never answered, when the store can still tell."""
        try:
            silent = [self.describe(o) for k, o in zip(keys, owners) if not self.store.check([k])]
        except RuntimeError:
            return f"lost the rendezvous store at {self.where}: {error}"
        if not silent:
            return str(error)
        seconds = self.timeout.total_seconds()
        return f"no answer within {seconds} s from {', '.join(silent)}; is that process alive? ({error})"

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.store.delete_key(key)

    def close(self) -> None:
        # NCCL backends of a failed group were aborted already; shutting them down again would wait on the dead peer.
        if not (self.device.type == "cuda" and self.failed_step is not None):
            for backend in self._backends:
                backend.shutdown()
        self._backends.clear()
        self.world = None
        self.store = None
