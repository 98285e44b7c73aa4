"""Move the bytes behind tensors to pinned host memory and back, leaving every tensor object in place.

DeepSpeed keeps each weight under several names: the module's parameter, a
flat buffer, its data-parallel partitions, the links from fp32 masters to
bf16 fragments. Moving one name (``param.data = param.data.to("cpu")``) leaves
the others holding the device memory, and re-pointing them all means knowing
every wrapper's internals. All those names are views of one storage, so we
move the storage instead: copy its bytes out, resize it to zero (the device
memory is released), and on reload resize it back and copy the bytes in. Every
view is whole again, whoever holds it.

While a storage is offloaded its views have no bytes; ``host_view`` reads a
tensor from the pinned copy (weight norms and file exports while asleep).

Freed is not yet given back: the caching allocator returns a segment to the
driver only when every block in it is free, and a weight that shares a segment
with an fp32 master or an activation stays reserved after it is freed (on
ZeRO-0, 70 of 236 MiB of bf16 weights did). So each part lives in a private
memory pool ("home") that holds nothing else: once the part is offloaded, the
pool is dropped and all of its segments go back to the driver.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


@dataclass
class _Offloaded:
    storage: torch.UntypedStorage  # the device storage, of size 0 while offloaded
    host: torch.Tensor  # its bytes, uint8 (pinned when the storage is on a GPU)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of the storage itself: a resized-to-zero storage has no data pointer left to tell it by."""
    return storage._cdata


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_home(device: torch.device):
    """A private CUDA memory pool for one part's storages (None off the GPU)."""
    return torch.cuda.MemPool() if device.type == "cuda" else None


def allocating_in(home) -> contextlib.AbstractContextManager:
    return torch.cuda.use_mem_pool(home) if home is not None else contextlib.nullcontext()


def move_home(storages: dict[int, torch.UntypedStorage], home) -> int:
    """Re-allocate each storage inside ``home`` (a device copy; views keep seeing the same bytes)."""
    moved = 0
    for storage in storages.values():
        nbytes = storage.nbytes()
        kept = _bytes_of(storage).clone()
        storage.resize_(0)
        with allocating_in(home):
            storage.resize_(nbytes)
        _bytes_of(storage).copy_(kept)
        moved += nbytes
    return moved


def unique_storages(tensors: Iterable[torch.Tensor | None], device: torch.device) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages on ``device``'s type behind ``tensors``."""
    storages = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type != device.type:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage_key(storage), storage)
    return storages


class StorageOffload:
    """One group of offloaded storages (the bf16 weights, or the optimizer's state)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._offloaded: dict[int, _Offloaded] = {}

    def __bool__(self) -> bool:
        return bool(self._offloaded)

    @property
    def nbytes(self) -> int:
        return sum(entry.host.numel() for entry in self._offloaded.values())

    def offload(self, storages: dict[int, torch.UntypedStorage]) -> int:
        """Copy each storage to host memory and release its device bytes; returns the bytes moved."""
        pin = self.device.type == "cuda"
        entries = {}
        for key, storage in storages.items():
            if key in self._offloaded:
                continue
            if not storage.resizable():
                raise ValueError(
                    f"cannot offload a {storage.nbytes()}-byte storage that is not resizable (file-mapped?)"
                )
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_of(storage), non_blocking=pin)
            entries[key] = _Offloaded(storage, host)
        _synchronize(self.device)  # the copies must land before the device bytes go
        for entry in entries.values():
            entry.storage.resize_(0)
        self._offloaded.update(entries)
        return sum(entry.host.numel() for entry in entries.values())

    def reload(self, home=None) -> int:
        """Give every storage its bytes back on the device, in ``home`` (new addresses, same tensors)."""
        moved = self.nbytes
        for entry in self._offloaded.values():
            with allocating_in(home):
                entry.storage.resize_(entry.host.numel())
            _bytes_of(entry.storage).copy_(entry.host, non_blocking=self.device.type == "cuda")
        _synchronize(self.device)  # before the host buffers are dropped
        self._offloaded.clear()
        return moved

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` read from its host copy, or None when its storage is not offloaded here."""
        entry = self._offloaded.get(storage_key(tensor.untyped_storage()))
        if entry is None:
            return None
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(entry.host.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


# DeepSpeed's names for what each sleep mode moves (the seeds' modes: all / non_lp / lp_params).
LP, NON_LP = "lp_params", "non_lp"
MODES = {"all": (NON_LP, LP), NON_LP: (NON_LP,), LP: (LP,)}


def tensors_in(value, depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors (and their gradients) held in ``value``, through lists, tuples and dicts ``depth`` deep."""
    if isinstance(value, torch.Tensor):
        yield value
        if value.grad is not None:
            yield value.grad
    elif depth and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth - 1)


class EngineOffload:
    """``sleep``/``wake`` for one DeepSpeed engine: what is off the device, and how each part comes back.

    - bf16 weights (``lp_params``), ZeRO 0-2: our ``StorageOffload`` of the module's parameter storages, which
      are also DeepSpeed's flat buffers; whatever views them is whole again on wake.
    - fp32 masters, moments, gradients (``non_lp``): DeepSpeed's ``offload_states`` where its ZeRO optimizer
      has it (stages 1-3); otherwise (stage 0's fp16/bf16 wrappers, a plain torch optimizer) our
      ``StorageOffload`` of every tensor the optimizer holds that is not a weight.
    - ZeRO-3 with an optimizer offloads both through DeepSpeed; without one (log-prob engines), the weights'
      partitions are ours.
    """

    def __init__(self, engine, zero_stage: int, device: torch.device):
        self.engine, self.zero_stage, self.device = engine, zero_stage, device
        self.asleep: set[str] = set()
        self._ours = {LP: StorageOffload(device), NON_LP: StorageOffload(device)}
        self._homes = {LP: None, NON_LP: None}

    @property
    def _optimizer(self):
        optimizer = self.engine.optimizer
        return None if optimizer is None or type(optimizer).__name__ == "DeepSpeedZeRoOffload" else optimizer

    def _with_deepspeed(self, part: str) -> bool:
        has_offload = hasattr(self._optimizer, "offload_states")
        return has_offload and (part == NON_LP or self.zero_stage == 3)

    def settle(self, part: str) -> int:
        """Move ``part``'s storages into a home of their own, unless they have one; bytes moved.

        The weights settle at setup; the optimizer's state after the first step, which creates AdamW's moments.
        Once settled, each wake re-allocates the part in a fresh home. ZeRO-3's partitions stay where they are.
        """
        if self.device.type != "cuda" or self.zero_stage == 3 or part in self.asleep or self._homes[part] is not None:
            return 0
        home = self._homes[part] = new_home(self.device)
        return move_home(self._storages(part), home)

    def sleep(self, mode: str) -> dict[str, int]:
        """Offload what ``mode`` names and is not off already; bytes moved per part."""
        moved = {}
        for part in MODES[mode]:  # non_lp first: DeepSpeed's offload of the masters reads the weights' links
            if part in self.asleep or (part == NON_LP and self._optimizer is None):
                continue
            if self._with_deepspeed(part):
                moved[part] = self._deepspeed_offload(part)
            else:
                moved[part] = self._ours[part].offload(self._storages(part))
            self._homes[part] = None  # its segments hold nothing now: dropping it gives them back
            self.asleep.add(part)
        return moved

    def wake(self) -> list[str]:
        """Bring back everything asleep: our weights first, so DeepSpeed's reload can link the masters to them."""
        for part in (LP, NON_LP):
            if part in self.asleep and not self._with_deepspeed(part):
                home = self._homes[part] = new_home(self.device)
                self._ours[part].reload(home)
        deepspeed_parts = [part for part in self.asleep if self._with_deepspeed(part)]
        if deepspeed_parts:
            home = new_home(self.device)
            with allocating_in(home):
                self.engine.reload_states(non_blocking=False)  # every state it offloaded, at once
            self._homes.update(dict.fromkeys(deepspeed_parts, home))
        woke, self.asleep = sorted(self.asleep), set()
        return woke

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, read from host memory while its storage is offloaded."""
        view = self._ours[LP].host_view(tensor)
        return tensor if view is None else view

    def _storages(self, part: str) -> dict[int, torch.UntypedStorage]:
        return self._weight_storages() if part == LP else self._state_storages()

    def _weight_storages(self) -> dict[int, torch.UntypedStorage]:
        params = self.engine.module.parameters()
        # ZeRO-3 keeps each rank's partition in ds_tensor (a forward-only engine has no optimizer to offload it).
        weights = (p.ds_tensor if self.zero_stage == 3 else p.data for p in params)
        return unique_storages(weights, self.device)

    def _state_storages(self) -> dict[int, torch.UntypedStorage]:
        """Every storage the optimizer holds that is not a weight's: fp32 masters, moments, gradient buffers."""
        optimizer = self._optimizer
        if optimizer is None:
            return {}
        inner = getattr(optimizer, "optimizer", optimizer)
        held = [
            tensors_in([group["params"] for group in inner.param_groups]),
            tensors_in(list(inner.state.values())),
            tensors_in(vars(optimizer)),  # a DeepSpeed wrapper's own buffers
            (p.grad for p in self.engine.module.parameters()),
        ]
        storages = unique_storages((t for source in held for t in source), self.device)
        for key in self._weight_storages():
            storages.pop(key, None)  # a plain optimizer steps the weights themselves: those stay
        return storages

    def _deepspeed_offload(self, part: str) -> int:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        states = [S.lp_params] if part == LP else [S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer]
        before = torch.cuda.memory_allocated(self.device)
        self.engine.offload_states(include=states, non_blocking=False)
        return before - torch.cuda.memory_allocated(self.device)
