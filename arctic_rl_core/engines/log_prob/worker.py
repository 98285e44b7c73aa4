"""One replica of the vLLM log-prob engine, as a Ray actor (``log_prob_engine="vllm"``)."""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

import torch

from arctic_rl_core.engines.batching import RowBatch
from arctic_rl_core.engines.runtime import configure_process
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions

T = TypeVar("T")


class VLLMLogProbWorker:
    def __init__(self, replica: int, model_path: str, options: SamplingEngineOptions, threads: int | None = None):
        from arctic_rl_core.engines.log_prob.vllm import VLLMLogProbEngine

        configure_process(options.device, threads)
        self.replica = replica
        self.engine = VLLMLogProbEngine(model_path, options)
        # Ray runs the calls on one engine thread (vLLM's forward state is per process), not the thread
        # that ran __init__; OpenMP's thread count is per thread, so each call sets the one chosen here.
        self._threads = torch.get_num_threads()

    def _on_engine(self, fn: Callable[[], T]) -> T:
        torch.set_num_threads(self._threads)
        return fn()

    def info(self) -> dict:
        return {"replica": self.replica, "pid": os.getpid(), "engine": "vllm"}

    def watch(self) -> None:
        """Blocks forever; the job awaits it so a dead replica is noticed at once, even when idle."""
        threading.Event().wait()

    def log_probs(self, prompts: list[str], completions: list[str] | None, top_k: int) -> list[dict]:
        return self._on_engine(lambda: self.engine.log_probs(prompts, completions, top_k))

    def token_log_probs(self, batch: RowBatch, top_k: int) -> dict:
        return self._on_engine(lambda: self.engine.token_log_probs(batch.input_ids, batch.attention_mask, top_k))

    def weight_norm(self) -> float:
        return self._on_engine(self.engine.weight_norm)

    def sleep(self, level: int) -> dict:
        return {"replica": self.replica, **self._on_engine(lambda: self.engine.sleep(level))}

    def wake(self, tags: list[str] | None) -> dict:
        return {"replica": self.replica, **self._on_engine(lambda: self.engine.wake(tags))}

    def shutdown(self) -> None:
        self._on_engine(self.engine.shutdown)
