"""CPU-file weight sync: safetensors shards in a directory, for training that is offloaded to CPU.

The sender writes every shard and the index into a staging directory next to
the target and then renames it into place, so a receiver sees the previous
complete set of weights or the new one, never a mix. The layout is the
Hugging Face one (``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json``), so the directory also loads with
``safetensors``/``transformers`` tooling. The receiver checks every name and
shape from the shard headers before it reads any tensor data.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from arctic_rl_core.weight_sync.buckets import plan_tensor_buckets
from arctic_rl_core.weight_sync.errors import WeightSyncError
from arctic_rl_core.weight_sync.validation import Shapes, check_shapes

INDEX_NAME = "model.safetensors.index.json"
# Bounds the CPU staging memory when the weights live on a GPU.
DEFAULT_SHARD_SIZE = 1 << 30


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _is_weights_dir(path: Path) -> bool:
    return all(p.name == INDEX_NAME or p.suffix == ".safetensors" for p in path.iterdir())


def _cpu_tensors(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors; safetensors refuses tensors that share storage, so those are cloned."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in named:
        cpu = tensor.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage().data_ptr()
        if storage in storages:
            cpu = cpu.clone()
        storages.add(cpu.untyped_storage().data_ptr())
        out[name] = cpu
    return out


def write_weights(
    weights: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike, *, shard_size: int = DEFAULT_SHARD_SIZE
) -> Path:
    """Write ``weights`` as safetensors shards of at most ``shard_size`` bytes into ``directory``; return it.

    ``directory`` is replaced as a whole, so it must hold nothing but weights
    written here (never point it at a model checkpoint with its config).
    """
    named = list(weights)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"weights must have unique names, got duplicates {duplicates}")
    target = Path(directory)
    if target.exists() and not (target.is_dir() and _is_weights_dir(target)):
        raise ValueError(
            f"directory={str(target)!r} holds files other than safetensors weights; "
            "write_weights replaces the whole directory, so give it one of its own"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.staging-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        by_name = dict(named)
        layouts = plan_tensor_buckets(named, shard_size)
        weight_map: dict[str, str] = {}
        total = 0
        for i, layout in enumerate(layouts):
            file_name = _shard_name(i, len(layouts))
            shard = _cpu_tensors([(n, by_name[n]) for n in layout.names])
            save_file(shard, staging / file_name, metadata={"format": "pt"})
            weight_map.update({n: file_name for n in layout.names})
            total += sum(t.nbytes for t in shard.values())
            del shard
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=1))
        retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex}"
        if target.exists():
            os.rename(target, retired)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)
    return target


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_NAME
    if not index.is_file():
        raise WeightSyncError("read weights", f"no weights at {str(directory)!r}: {INDEX_NAME} is missing")
    return json.loads(index.read_text())["weight_map"]


def stored_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor in a weights directory, read from the shard headers only."""
    directory = Path(directory)
    weight_map = _weight_map(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file_name in dict.fromkeys(weight_map.values()):
        with safe_open(directory / file_name, framework="pt") as shard:
            for name in shard.keys():
                shapes[name] = tuple(shard.get_slice(name).get_shape())
    return {name: shapes[name] for name in weight_map}


def read_weights(
    directory: str | os.PathLike, *, expected: Shapes | None = None, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Check names and shapes against ``expected`` now, then yield (name, tensor) in the order written.

    Raises ``WeightMismatchError`` before any tensor is read when the set
    differs from ``expected``.
    """
    directory = Path(directory)
    if expected is not None:
        check_shapes(stored_shapes(directory), expected)
    return _tensors(directory, _weight_map(directory), str(device))


def _tensors(directory: Path, weight_map: dict[str, str], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        by_file.setdefault(file_name, []).append(name)
    for file_name, names in by_file.items():
        with safe_open(directory / file_name, framework="pt", device=device) as shard:
            for name in names:
                yield name, shard.get_tensor(name)
