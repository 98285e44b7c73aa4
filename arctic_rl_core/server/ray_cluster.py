"""Joining or starting the Ray cluster the jobs run on, and telling real GPUs from CPU stand-ins.

On a machine without CUDA we start Ray with N "GPU" resources so placement
groups, fractional colocation and scheduling run the same code path as on a
GPU cluster; a marker resource records that those GPUs are CPU workers.
"""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)

CPU_GPU_MARKER = "arctic_rl_cpu_gpus"
DEFAULT_NAMESPACE = "arctic-rl"


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def connect(
    auto_attach: bool, namespace: str = DEFAULT_NAMESPACE, cpu_gpus: int = 8, log_to_driver: bool = True
) -> str:
    """Make sure Ray is initialized; return the cluster's device kind, "cuda" or "cpu".

    ``auto_attach`` joins a running cluster only when it offers GPU resources
    (an unrelated CPU-only cluster would strand the jobs); otherwise a fresh
    local cluster is started.
    """
    if not ray.is_initialized():
        attached = auto_attach and _attach(namespace, log_to_driver)
        if not attached:
            _start_local(namespace, cpu_gpus, log_to_driver)
    return cluster_device()


def cluster_device() -> str:
    resources = ray.cluster_resources()
    if resources.get(CPU_GPU_MARKER, 0) > 0 or resources.get("GPU", 0) == 0:
        return "cpu"
    return "cuda"


def _attach(namespace: str, log_to_driver: bool) -> bool:
    if not (os.environ.get("RAY_ADDRESS") or _local_cluster_running()):
        return False
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace=namespace, log_to_driver=log_to_driver)
    except (ConnectionError, RuntimeError) as exc:
        logger.info("no Ray cluster to attach to (%s); starting one", exc)
        return False
    if ray.cluster_resources().get("GPU", 0) > 0:
        logger.info("attached to the running Ray cluster: %s", ray.cluster_resources())
        return True
    logger.info("the running Ray cluster has no GPU resources; starting a fresh one")
    ray.shutdown()
    return False


def _local_cluster_running() -> bool:
    from pathlib import Path

    return Path("/tmp/ray/ray_current_cluster").exists()


def _start_local(namespace: str, cpu_gpus: int, log_to_driver: bool) -> None:
    gpus = cuda_device_count()
    extra = {}
    if gpus == 0:
        gpus = cpu_gpus
        extra["resources"] = {CPU_GPU_MARKER: cpu_gpus}
    ray.init(
        namespace=namespace,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        object_store_memory=int(os.environ.get("ARCTIC_RL_OBJECT_STORE_BYTES", 2 * 1024**3)),
        **extra,
    )
    logger.info("started a local Ray cluster: %s", ray.cluster_resources())
