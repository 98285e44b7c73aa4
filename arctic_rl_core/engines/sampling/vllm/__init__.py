"""The vLLM sampling backend.

One ``VLLMBackend`` is one replica: a ``vllm.LLM`` engine whose engine core
runs in the owning worker's process and whose ``tensor_parallel_size``
ranks are vLLM's own workers. A sampling job of ``sampling_gpus`` GPUs runs
``num_replicas(sampling_gpus, tensor_parallel_size)`` =
``sampling_gpus // tensor_parallel_size`` such workers; spreading requests
over them (load balancing) is the server's job, not the backend's.

- ``engine_args``: options and ``vllm_config`` -> vLLM engine arguments,
  ArcticInference (FCA) switches.
- ``backend``: ``VLLMBackend`` (generate, prompt log-probs, weight reload,
  weight norm, prefix-cache reset, sleep/wake).
- ``worker_ops``: what runs inside vLLM's workers.
- ``selection``: ``sampling_engine: auto`` -> a backend class.

Importing this package does not import vLLM; building a backend does.
"""

from arctic_rl_core.engines.sampling.vllm.backend import PromptLogProbs, VLLMBackend
from arctic_rl_core.engines.sampling.vllm.engine_args import num_replicas, vllm_engine_kwargs
from arctic_rl_core.engines.sampling.vllm.selection import select_sampling_backend, vllm_supports

__all__ = [
    "PromptLogProbs",
    "VLLMBackend",
    "num_replicas",
    "select_sampling_backend",
    "vllm_engine_kwargs",
    "vllm_supports",
]
