"""Process-level setup shared by every worker: device choice, threads, caches, memory readings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# DeepSpeed JIT-builds its C++ ops (the CPU shm all-reduce among them) on first use: keep one known cache,
# per Python version (an op built for 3.12 does not load in 3.11).
DEFAULT_EXTENSIONS_DIR = (
    Path.home() / ".cache" / "arctic-rl" / f"torch_extensions_py{sys.version_info[0]}{sys.version_info[1]}"
)


def resolve_device(requested: str) -> str:
    """ "auto" -> "cuda" when CUDA is available, else "cpu"; "cuda" without CUDA is an error."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError('device="cuda" but torch sees no CUDA device; use device="cpu" or "auto"')
    return requested


def configure_process(device: str, threads: int | None = None) -> torch.device:
    """Pick this worker's device (Ray sets CUDA_VISIBLE_DEVICES to its GPU) and bound CPU threads."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        # Before deepspeed is imported: never probe for accelerators on a CPU worker.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if threads:
        torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on this host right now (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def device_memory(reserved: bool = False) -> int:
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.memory_reserved() if reserved else torch.cuda.memory_allocated()


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's workspaces: PyTorch keeps a 32 MiB one per (handle, stream), for the whole process.

    Each is allocated wherever the first matmul on that handle and stream found room: often inside a
    large activation segment, which it then pins (a sleeping training engine held 1 GiB that way), or
    inside a CUDA-graph pool during capture, which it then outlives. The next matmul allocates afresh.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds only
    if clear is not None and torch.cuda.is_available():
        clear()


def empty_device_cache() -> None:
    """Give the driver back every cached segment, cuBLAS's workspaces included."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
