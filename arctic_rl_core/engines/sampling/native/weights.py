"""Hugging Face parameter names onto the native model's fused layout, from checkpoints or live tensors.

Names are the ones ``AutoModelForCausalLM.state_dict()`` uses (and so the
training engine's weight sync). ``q_proj``/``k_proj``/``v_proj`` land in row
slices of ``qkv_proj``, ``gate_proj``/``up_proj`` in ``gate_up_proj``; with tied
embeddings ``lm_head.weight`` is the embedding.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from arctic_rl_core.engines.sampling.native.model import CausalLM
from arctic_rl_core.weight_sync.batched_copy import BatchedCopy

# Buffers some checkpoints carry; they are derived from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shards(model: CausalLM) -> dict[str, tuple[str, slice]]:
    """HF projection name -> (our fused parameter name, rows it occupies)."""
    spec = model.spec
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
    }


@dataclass
class _Replay:
    """A batched load to repeat while the same source tensors come back (an IPC session's cached views)."""

    sources: list[weakref.ref]  # weak: a forgotten mapping must be able to go
    dests: list[torch.Tensor]
    copy: BatchedCopy

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        return len(tensors) == len(self.sources) and all(ref() is t for ref, t in zip(self.sources, tensors))


class WeightLoader:
    """Copies named tensors into a ``CausalLM`` and remembers which parameter rows it filled.

    Names resolve to destination views once. With ``batched=True`` tensors
    already on the model's CUDA device (a CUDA-IPC sync's views) are copied
    together at the end of ``load``, in one launch, and a repeat load of the
    same tensors (the next sync of an IPC session) skips straight to that
    launch; otherwise every tensor is copied as it streams by, so a checkpoint
    never sits twice on the device. A loader belongs to the model's current
    storage: make a new one after the weights move (sleep level 2).
    """

    def __init__(self, model: CausalLM):
        self.model = model
        self.params = dict(model.named_parameters())
        self.shards = _shards(model)
        self.filled: set[tuple[str, int]] = set()
        self._destinations: dict[str, tuple[torch.Tensor, tuple[str, int]] | None] = {}
        self._replays: dict[tuple[str, ...], _Replay] = {}  # by the names loaded together

    def target(self, hf_name: str) -> tuple[str, slice] | None:
        """Our parameter name and row slice for an HF name; None for buffers we derive ourselves."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.model.spec.tie_word_embeddings:
            name = "embed_tokens.weight"
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            module, _, kind = rest.rpartition(".")
            if module in self.shards:
                fused, rows = self.shards[module]
                return f"layers.{index}.{fused}.{kind}", rows
        if name not in self.params:
            raise ValueError(f"weight {hf_name!r} has no place in the native {self.model.spec.model_type} model")
        return name, slice(0, self.params[name].shape[0])

    def _destination(self, hf_name: str) -> tuple[torch.Tensor, tuple[str, int]] | None:
        if hf_name not in self._destinations:
            target = self.target(hf_name)
            if target is not None:
                name, rows = target
                param = self.params.get(name)
                if param is None:
                    raise ValueError(f"weight {hf_name!r} maps to {name!r}, which this model does not have")
                target = param.data[rows], (name, rows.start)
            self._destinations[hf_name] = target
        return self._destinations[hf_name]

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], batched: bool = False) -> int:
        """Copy every ``(hf_name, tensor)``; returns how many were copied."""
        if not batched:
            return sum(self._copy_now(name, tensor) for name, tensor in weights)
        pairs = list(weights)
        names = tuple(name for name, _ in pairs)
        tensors = [tensor for _, tensor in pairs]
        replay = self._replays.get(names)
        if replay is not None and replay.matches(tensors):
            replay.copy(replay.dests, tensors)
            return len(tensors)
        dests, sources = [], []
        count = 0
        for name, tensor in pairs:
            destination = self._checked_destination(name, tensor)
            if destination is None:
                continue
            if destination.is_cuda and tensor.device == destination.device:
                dests.append(destination)
                sources.append(tensor)
            else:
                destination.copy_(tensor)
            count += 1
        copy = BatchedCopy(dests, sources)
        copy(dests, sources)
        if len(sources) == len(pairs):  # all of it in one launch: repeatable as is
            self._replays[names] = _Replay([weakref.ref(t) for t in sources], dests, copy)
        return count

    def _copy_now(self, name: str, tensor: torch.Tensor) -> int:
        destination = self._checked_destination(name, tensor)
        if destination is None:
            return 0
        destination.copy_(tensor)
        return 1

    def _checked_destination(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        destination = self._destination(hf_name)
        if destination is None:
            return None
        dest, filled = destination
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}; expected {tuple(dest.shape)}")
        self.filled.add(filled)
        return dest

    def missing(self) -> list[str]:
        """Parameters (or fused shards) that no loaded tensor has filled."""
        expected = set()
        for name, param in self.params.items():
            module = name.rsplit(".", 1)[0]
            starts = [rows.start for fused, rows in self.shards.values() if module.endswith(fused)]
            expected.update((name, start) for start in (starts or [0]))
        return sorted(f"{name}[{start}:]" if start else name for name, start in expected - self.filled)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (or the single file given)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights at {str(path)!r}")
    return files


def iter_checkpoint(path: str | os.PathLike, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of a safetensors checkpoint, read straight onto ``device``."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_checkpoint(model: CausalLM, path: str | os.PathLike, device: torch.device) -> None:
    """Fill every parameter of ``model`` from a checkpoint; a parameter left unfilled is an error."""
    loader = WeightLoader(model)
    loader.load(iter_checkpoint(path, device))
    missing = loader.missing()
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks weights for {missing[:8]}"
                         f"{' and more' if len(missing) > 8 else ''}")  # fmt: skip
