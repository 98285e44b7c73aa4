"""verl's processes without an accelerator: a ``cpu`` platform for verl's platform registry.

With the arctic backend verl's own workers do no model compute: arctic-rl
does, on GPUs it places itself. verl 0.9.1 still picks a device for its
workers (``verl.plugin.platform``: ``VERL_PLATFORM`` or auto-detection) and
reserves one accelerator per worker in Ray. This platform keeps them on the
host:

- device ``cpu``, collectives over gloo;
- Ray resource ``CPU``: verl's worker bundles reserve a CPU, not a GPU, so
  every GPU of the cluster stays free for arctic-rl's jobs. (verl still checks
  that the cluster has ``trainer.n_gpus_per_node`` GPUs: on a CPU-only host
  declare stand-ins at ``ray.init``, ``+ray_kwargs.ray_init.num_gpus=N``, which
  arctic-rl's jobs then use as its own CPU workers do.)

It is picked by ``VERL_PLATFORM=cpu``, and auto-detected only where torch is a
CPU-only build (no CUDA, ROCm or NPU support compiled in), so it can never
shadow a real accelerator by accident.

One shim is needed, and is applied only while this platform is active:
``verl/utils/distributed.py: initialize_global_process_group_ray`` builds the
backend string ``f"cpu:gloo,{device}:{backend}"``, which for the cpu device is
``"cpu:gloo,cpu:gloo"``, and torch rejects a duplicate device type
(``ValueError: Duplicate device type cpu``). ``install_gloo_process_group``
wraps that function so it asks for ``"cpu:gloo"`` instead. Remove it once verl
builds the string without the duplicate.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def cpu_only_torch() -> bool:
    """True when this torch build cannot drive any accelerator verl knows."""
    return torch.version.cuda is None and torch.version.hip is None and not hasattr(torch, "npu")


class CPUDeviceModule:
    """What verl calls on ``get_torch_device()``, for host memory.

    ``torch.cpu`` has the stream and device calls but none of the allocator
    statistics verl reads after every step, so those are answered here: host
    tensors have no caching allocator, hence nothing to empty and no peak to
    report (verl logs host memory separately, as ``perf/cpu_memory_used_gb``).
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Optional[int] = None) -> str:
        # verl's FLOPS table has a "CPU" entry: MFU is reported against it.
        return "CPU"

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def memory_allocated(device: Optional[int] = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Optional[int] = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Optional[int] = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Optional[int] = None) -> int:
        return 0

    @staticmethod
    def mem_get_info(device: Optional[int] = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Optional[int] = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Optional[int] = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Optional[int] = None) -> None:
        torch.set_rng_state(state)


class PlatformCPU(PlatformBase):
    """verl's workers on host CPUs, placed on ``CPU`` Ray resources."""

    _device_module = CPUDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> CPUDeviceModule:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return cpu_only_torch()

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # verl asks for a share of one accelerator per worker; here it is the same share of its CPU bundle.
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


def register_cpu_platform() -> None:
    """Add ``cpu`` to verl's platforms unless verl (or someone) already has one by that name."""
    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)


def cpu_platform_active() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


def install_gloo_process_group() -> None:
    """Make verl's worker process groups gloo-only on the cpu device (see the module docstring)."""
    from verl.utils import distributed
    from verl.workers import engine_workers

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "__arctic_gloo__", False):
        return

    @functools.wraps(original)
    def initialize_gloo_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_gloo_process_group_ray.__arctic_gloo__ = True
    distributed.initialize_global_process_group_ray = initialize_gloo_process_group_ray
    # engine_workers imported the function by name, so its reference is replaced too.
    engine_workers.initialize_global_process_group_ray = initialize_gloo_process_group_ray
