"""From ``SamplingEngineOptions`` to the keyword arguments of ``vllm.LLM``.

Everything a user can say about the vLLM engine arrives here: the common
option fields, ``options.extra`` (the rest of ``vllm_config``, passed through
as vLLM engine arguments, unknown names rejected), and the ArcticInference
switches (``use_fca``, ``zorro_inference.enable``, ``spec_model``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions

logger = logging.getLogger(__name__)

# Spellings of the seeds' ``vllm_config`` that vLLM names differently.
ENGINE_ARG_ALIASES = {"max_seq_len": "max_model_len"}

# Keys of ``extra`` that configure ArcticInference rather than vLLM itself.
ARCTIC_KEYS = ("zorro_inference", "spec_model")

# Set by the caller of the backend, never through ``extra``.
RESERVED_ENGINE_ARGS = {
    "model": "the model comes from model_name",
    # vLLM also has logit modes; ``Completion.logprobs`` are log-probs, so the option field checks the value.
    "logprobs_mode": "it is the option logprobs_mode ('raw_logprobs' or 'processed_logprobs')",
}

CPU_KV_CACHE_BYTES = 1 << 30

FCA_NEEDS_ARCTIC_INFERENCE = (
    "Forest Cascade Attention (use_fca / zorro_inference.enable) needs the arctic_inference package with vLLM "
    "on CUDA; vLLM runs without it here. The native sampling engine (sampling_engine='native') has FCA built in."
)


def num_replicas(sampling_gpus: int, tensor_parallel_size: int) -> int:
    """Independent vLLM engines of a sampling job: each spans ``tensor_parallel_size`` GPUs."""
    if tensor_parallel_size < 1:
        raise ValueError(f"vllm_config.tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if sampling_gpus < tensor_parallel_size or sampling_gpus % tensor_parallel_size:
        raise ValueError(
            f"sampling_gpus ({sampling_gpus}) must be a positive multiple of "
            f"vllm_config.tensor_parallel_size ({tensor_parallel_size})"
        )
    return sampling_gpus // tensor_parallel_size


def prepare_vllm_process(device: str) -> None:
    """Set the environment vLLM reads when it first resolves its platform and builds an engine.

    ``VLLM_TARGET_DEVICE=cpu`` makes vLLM pick its CPU platform explicitly
    (left to probe, a CPU build may load kernels the CPU lacks).
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this process:
    weights reach a single-GPU (or CPU) worker by reference, and the functions
    that ``collective_rpc`` sends to workers need no insecure serialization.
    """
    if device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def check_platform(device: str) -> None:
    """Fail early, by name, when the installed vLLM does not drive ``device``."""
    from vllm.platforms import current_platform

    if current_platform.device_type != device:
        raise RuntimeError(
            f"options.device is {device!r} but the installed vLLM runs on {current_platform.device_type!r} "
            f"(VLLM_TARGET_DEVICE={os.environ.get('VLLM_TARGET_DEVICE')!r}); install the vLLM build for {device} "
            "or use the native sampling engine"
        )


def arctic_inference_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


def fca_requested(options: SamplingEngineOptions) -> bool:
    """``arctic_inference_config.use_fca`` (an option field) or ``zorro_inference.enable`` (left in extra)."""
    zorro = options.extra.get("zorro_inference") or {}
    if not isinstance(zorro, dict):
        raise ValueError(
            f"arctic_inference_config.zorro_inference must be a dict like {{'enable': True}}, got {zorro!r}"
        )
    return bool(options.use_fca or zorro.get("enable", False))


def accepted_engine_args() -> set[str]:
    """Names ``vllm.LLM`` accepts: its parameters and ``EngineArgs`` fields (ArcticInference's too, once loaded)."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    engine_args_cls = EngineArgs
    if arctic_inference_available() and os.environ.get("ARCTIC_INFERENCE_ENABLED") == "1":
        from arctic_inference.vllm.args import ArcticEngineArgs

        engine_args_cls = ArcticEngineArgs
    own = {name for name in inspect.signature(LLM.__init__).parameters if name not in ("self", "kwargs")}
    return own | {f.name for f in dataclasses.fields(engine_args_cls)}


def vllm_engine_kwargs(options: SamplingEngineOptions) -> dict:
    """Validated keyword arguments for ``vllm.LLM(model=..., **kwargs)``.

    Fields of ``options`` map to vLLM's names; ``extra`` may add any other
    engine argument but may not restate a field under another spelling.
    ``block_size`` is passed only when set explicitly: vLLM's CPU attention
    wants multiples of 32 and picks a valid default per platform.
    """
    extra = {ENGINE_ARG_ALIASES.get(key, key): value for key, value in options.extra.items() if key not in ARCTIC_KEYS}
    for alias, name in ENGINE_ARG_ALIASES.items():
        if alias in options.extra and name in options.extra:
            raise ValueError(f"vllm_config sets both {alias!r} and {name!r}; they are the same setting, keep one")

    kwargs = {
        "dtype": options.dtype,
        "seed": options.seed,
        "max_num_seqs": options.max_num_seqs,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "enable_prefix_caching": options.enable_prefix_caching,
        "enforce_eager": options.enforce_eager,
        "tensor_parallel_size": options.tensor_parallel_size,
        "logprobs_mode": options.logprobs_mode,
    }
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    if "block_size" in options.model_fields_set:
        kwargs["block_size"] = options.block_size
    if options.device == "cuda":
        # Colocated RL frees sampling memory for training between rollouts.
        kwargs["enable_sleep_mode"] = True
    else:
        kwargs.update(_cpu_defaults(options, extra))

    for name, value in extra.items():
        if name in RESERVED_ENGINE_ARGS:
            raise ValueError(f"options.extra['{name}'] cannot be set: {RESERVED_ENGINE_ARGS[name]}")
        if name in kwargs and name in options.model_fields_set and kwargs[name] != value:
            raise ValueError(
                f"vllm_config.{name}={value!r} conflicts with the option {name}={kwargs[name]!r}; set it once"
            )
    kwargs.update(extra)
    kwargs.update(_arctic_inference_kwargs(options, kwargs))

    unknown = sorted(set(kwargs) - accepted_engine_args())
    if unknown:
        raise ValueError(
            f"unknown vLLM engine argument(s) in vllm_config: {unknown}; expected names of vllm.EngineArgs "
            f"(aliases: {ENGINE_ARG_ALIASES}) or ArcticInference keys {list(ARCTIC_KEYS)}"
        )
    return kwargs


def _cpu_defaults(options: SamplingEngineOptions, extra: dict) -> dict:
    """What vLLM's CPU build needs unless the user says otherwise.

    Eager mode: its compiled mode builds C++ kernels with inductor at start-up.
    A bounded KV cache: vLLM would otherwise give it ``gpu_memory_utilization``
    of the machine's RAM, and CPU runs are development boxes shared with
    training workers.
    """
    out = {}
    if "enforce_eager" not in options.model_fields_set:
        out["enforce_eager"] = True
    explicit_kv = "kv_cache_memory_bytes" in extra or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if not explicit_kv and "gpu_memory_utilization" not in options.model_fields_set:
        out["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return out


def _arctic_inference_kwargs(options: SamplingEngineOptions, kwargs: dict) -> dict:
    """Engine arguments that turn on ArcticInference's FCA / speculative decoding, when it can run.

    Where it can, this enables the ArcticInference vLLM plugin for the
    process (``ARCTIC_INFERENCE_ENABLED=1``, read by vLLM's workers too).
    """
    want_fca = fca_requested(options)
    spec_model = options.extra.get("spec_model")
    if not (want_fca or spec_model):
        return {}
    if options.device != "cuda" or not arctic_inference_available():
        if want_fca:
            logger.info(FCA_NEEDS_ARCTIC_INFERENCE)
        if spec_model:
            logger.info("spec_model=%r ignored: speculative decoding needs arctic_inference on CUDA", spec_model)
        return {}

    # The plugin patches vllm.EngineArgs to accept its fields; it loads only
    # when enabled, and must load before the engine arguments are built.
    os.environ["ARCTIC_INFERENCE_ENABLED"] = "1"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out: dict = {}
    if want_fca and "forest_cascade_attn_configs" not in kwargs:
        out["forest_cascade_attn_configs"] = "{}"
    elif isinstance(kwargs.get("forest_cascade_attn_configs"), dict):
        out["forest_cascade_attn_configs"] = json.dumps(kwargs["forest_cascade_attn_configs"])
    if want_fca and "compilation_config" not in kwargs:
        # FCA regroups each decode batch, so it runs outside full CUDA graphs
        # (ArcticInference's own server makes the same choice).
        out["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    if spec_model and "speculative_config" not in kwargs:
        out["speculative_config"] = {"method": "arctic", "model": spec_model, "num_speculative_tokens": 3}
    return out
