"""One sampling replica, as a Ray actor: a backend (native or vLLM) behind the sampling protocol.

The worker tokenizes prompts, decodes results into the seeds' result dicts,
loads synced weights, and resets the prefix cache after every load (a stale
prefix cache after an update is a known source of train/sample mismatch).
Calls are serialized per replica; the job spreads load across replicas.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable

import torch

from arctic_rl_core.engines.runtime import configure_process
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams


def backend_class(name: str, device: str):
    """The backend class for ``name``: "native", "vllm", or "auto" (vLLM where it imports on CUDA, else native)."""
    if name == "auto":
        name = "vllm" if device == "cuda" and _vllm_importable() else "native"
    if name == "vllm":
        from arctic_rl_core.engines.sampling.vllm import VLLMBackend

        return VLLMBackend
    if name == "native":
        from arctic_rl_core.engines.sampling.native import NativeEngine

        return NativeEngine
    raise ValueError(f'sampling_engine must be "auto", "native" or "vllm", got {name!r}')


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class SamplingWorker:
    def __init__(self, replica: int, model_path: str, engine: str, options: SamplingEngineOptions, threads=None):
        from transformers import AutoTokenizer

        self.replica = replica
        configure_process(options.device, threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.backend = backend_class(engine, options.device)(model_path, options)
        self.engine_name = type(self.backend).__name__
        self._lock = threading.Lock()
        self.weight_version = 0

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
        with self._lock:
            completions = self.backend.generate(prompt_token_ids, params)
        texts = prompts if prompts is not None else [self.tokenizer.decode(ids) for ids in prompt_token_ids]
        return [
            {"prompt": text, "prompt_token_ids": ids, "outputs": [c.to_dict() for c in outs]}
            for text, ids, outs in zip(texts, prompt_token_ids, completions)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        with self._lock:
            self.backend.load_weights(weights)
            self.backend.reset_prefix_cache()
            self.weight_version += 1
        return {"replica": self.replica, "weight_version": self.weight_version}

    def load_weights_from_file(self, directory: str) -> dict:
        from arctic_rl_core.weight_sync.file_sync import read_weights

        return self.load_weights(read_weights(directory))

    def weight_norm(self) -> float:
        with self._lock:
            return self.backend.weight_norm()

    def reset_prefix_cache(self) -> dict:
        with self._lock:
            self.backend.reset_prefix_cache()
        return {"replica": self.replica, "status": "ok"}

    def sleep(self, level: int) -> dict:
        with self._lock:
            return {"replica": self.replica, **self.backend.sleep(level)}

    def wake(self, tags: list[str] | None) -> dict:
        with self._lock:
            return {"replica": self.replica, **self.backend.wake(tags)}

    def shutdown(self) -> None:
        self.backend.shutdown()
