"""One sampling replica, as a Ray actor: a backend (native or vLLM) behind the sampling protocol.

The worker tokenizes prompts, decodes results into the seeds' result dicts,
loads synced weights, and resets the prefix cache after every load (a stale
prefix cache after an update is a known source of train/sample mismatch).
A step-wise backend (the native engine) is driven by an ``EngineLoop``, so
concurrent generate calls join one running batch; other backends serve one
call at a time. The job spreads load across replicas.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Iterable

import torch

from arctic_rl_core.engines.runtime import configure_process
from arctic_rl_core.engines.sampling.engine_loop import EngineLoop
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams


class SamplingWorker:
    def __init__(self, replica: int, model_path: str, engine: str, options: SamplingEngineOptions, threads=None):
        from transformers import AutoTokenizer

        self.replica = replica
        configure_process(options.device, threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        from arctic_rl_core.engines.sampling.vllm.selection import select_sampling_backend

        # Replicas draw unseeded requests' noise from their engine's seed: the same seed everywhere would give
        # every replica the same completions for the same prompts (the job splits batches evenly).
        options = options.model_copy(update={"seed": options.seed + replica})
        self.backend = select_sampling_backend(engine, options.device)(model_path, options)
        self.engine_name = type(self.backend).__name__
        self._lock = threading.Lock()
        self._loop = EngineLoop(self.backend) if hasattr(self.backend, "add_request") else None
        self.weight_version = 0
        self._ipc_mappings = None
        self._model_path = model_path
        self._device = options.device
        self._coordinator = None  # split placement's weight-sync group

    def _on_engine(self, fn):
        """Run ``fn(backend)`` where the backend may be touched: its loop thread, or under the lock."""
        if self._loop is not None:
            return self._loop.call(fn)
        with self._lock:
            return fn(self.backend)

    def info(self) -> dict:
        return {"replica": self.replica, "pid": os.getpid(), "engine": self.engine_name}

    def watch(self) -> None:
        """Blocks forever; the job awaits it so a dead replica is noticed at once, even when idle."""
        threading.Event().wait()

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: list[str] | None, prompt_token_ids: list[list[int]] | None, params: SamplingParams):
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize(prompts)
        if self._loop is not None:
            futures = self._loop.submit_all(prompt_token_ids, params)
            completions = [future.result() for future in futures]
        else:
            with self._lock:
                completions = self.backend.generate(prompt_token_ids, params)
        texts = prompts if prompts is not None else [self.tokenizer.decode(ids) for ids in prompt_token_ids]
        return [
            {"prompt": text, "prompt_token_ids": ids, "outputs": [c.to_dict() for c in outs]}
            for text, ids, outs in zip(texts, prompt_token_ids, completions)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        def load(backend) -> None:
            backend.load_weights(weights)
            backend.reset_prefix_cache()

        self._on_engine(load)
        self.weight_version += 1
        return {"replica": self.replica, "weight_version": self.weight_version}

    def load_ipc(self, buckets: list) -> dict:
        """Load weights from CUDA-IPC buckets of the training rank on this GPU (the handles travel by Ray).

        Buckets of the training engine's IPC session stay mapped for the next sync until ``forget_ipc``.
        """
        from arctic_rl_core.weight_sync.cuda_ipc import IpcMappings, load_shared_buckets

        if self._ipc_mappings is None:
            self._ipc_mappings = IpcMappings()

        def load(backend) -> None:
            load_shared_buckets(buckets, backend.load_weights, mappings=self._ipc_mappings)
            backend.reset_prefix_cache()

        self._on_engine(load)
        self.weight_version += 1
        return {"replica": self.replica, "weight_version": self.weight_version, "buckets": len(buckets)}

    def forget_ipc(self) -> dict:
        """Unmap the buffers of the training engine's IPC session, so that it can free them."""
        # On the engine's thread: a load in flight there reads these mappings.
        count = self._on_engine(lambda _: self._ipc_mappings.forget()) if self._ipc_mappings is not None else 0
        return {"replica": self.replica, "unmapped": count}

    def load_coordinated(self, group: tuple[dict, str] | None) -> dict:
        """Receive one sync through the weight-sync group, checked against the model's HF names and shapes.

        ``group`` (config, rendezvous address) first joins a new group as replica
        ``self.replica``; every member joins at once, this being its rendezvous.
        """
        from arctic_rl_core.config import WeightSyncConfig
        from arctic_rl_core.weight_sync import InferenceTarget, WeightSyncCoordinator

        if group is not None:
            self.coordinator_close()
            config, master_addr = group
            self._coordinator = WeightSyncCoordinator(
                WeightSyncConfig(**config), InferenceTarget(self.replica, 0), master_addr=master_addr,
                device=self._device,
            )  # fmt: skip
        if self._coordinator is None:
            raise RuntimeError("load_coordinated without a weight-sync group")
        expected = hf_parameter_shapes(self._model_path)

        def load(backend) -> None:
            backend.load_weights(self._coordinator.receive(expected))
            backend.reset_prefix_cache()

        self._on_engine(load)
        self.weight_version += 1
        return {"replica": self.replica, "weight_version": self.weight_version}

    def coordinator_close(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()
        self._coordinator = None

    def load_weights_from_file(self, directory: str) -> dict:
        from arctic_rl_core.weight_sync.file_sync import read_weights

        return self.load_weights(read_weights(directory))

    def weight_norm(self) -> float:
        return self._on_engine(lambda backend: backend.weight_norm())

    def reset_prefix_cache(self) -> dict:
        self._on_engine(lambda backend: backend.reset_prefix_cache())
        return {"replica": self.replica, "status": "ok"}

    def sleep(self, level: int) -> dict:
        return {"replica": self.replica, **self._on_engine(lambda backend: backend.sleep(level))}

    def wake(self, tags: list[str] | None) -> dict:
        return {"replica": self.replica, **self._on_engine(lambda backend: backend.wake(tags))}

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.stop()
        self.backend.shutdown()


@functools.cache
def hf_parameter_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the HF model's parameters, as a training engine names them (tied weights once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
