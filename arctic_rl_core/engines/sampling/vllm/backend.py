"""``VLLMBackend``: the sampling protocol over one ``vllm.LLM`` engine.

What it relies on in vLLM (0.31): the public methods of ``vllm.LLM`` --
``generate`` with token-id prompts, ``reset_prefix_cache``, ``sleep`` /
``wake_up``, ``collective_rpc`` -- with the worker method ``reload_weights``
(vLLM's in-place reload for RL: it re-runs each layer's post-load processing,
which the CPU build needs because it packs linear weights for its GEMM
kernels) and the functions of ``worker_ops``; from ``LLM.llm_engine``, the
model config, ``is_sleeping`` and the engine core's ``shutdown`` (``LLM``
has no shutdown of its own).
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass
from typing import Iterable

import torch

from arctic_rl_core.engines.sampling.protocol import (
    Completion,
    SamplingEngineOptions,
    SamplingParams,
    check_prompt,
    check_sampling_params,
)
from arctic_rl_core.engines.sampling.vllm import worker_ops
from arctic_rl_core.engines.sampling.vllm.engine_args import check_platform, prepare_vllm_process, vllm_engine_kwargs

_SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # odd, so seeds distinct mod 2**63 stay distinct

SLEEP_NEEDS_CUDA = "vLLM sleep mode needs CUDA; on CPU the engine keeps its weights and KV cache"

# The engine alive in this process, if any. vLLM keeps one set of process
# groups per process and an engine's shutdown tears them down, so two engines
# cannot share a process.
_live_engine: "VLLMBackend | None" = None


@dataclass
class PromptLogProbs:
    """How likely the model finds a token sequence: entry i scores ``token_ids[i]`` given every token before it."""

    token_ids: list[int]
    logprobs: list[float]
    # The ``top_k`` most likely tokens at each scored position, best first, as (token id, log-prob).
    top_logprobs: list[list[tuple[int, float]]]


class VLLMBackend:
    """One vLLM engine: one sampling replica, its tensor-parallel ranks inside it.

    Log-probs follow ``options.logprobs_mode``, vLLM's own setting of that name:
    the model's logits (``raw_logprobs``) or the processed sampling distribution.
    """

    def __init__(self, model_path: str, options: SamplingEngineOptions) -> None:
        global _live_engine
        if _live_engine is not None:
            raise RuntimeError(
                "a vLLM engine is already running in this process; vLLM allows one per process: shut it down "
                "first, or give each engine its own worker process"
            )
        prepare_vllm_process(options.device)
        check_platform(options.device)
        from vllm import LLM

        self.options = options
        # vLLM's CPU worker disables torch.set_num_threads, for the OpenMP
        # pinning its worker processes get; an in-process worker is not
        # pinned, and the process that owns the backend keeps that control.
        set_num_threads = torch.set_num_threads
        self.llm = LLM(model=str(model_path), **vllm_engine_kwargs(options))
        torch.set_num_threads = set_num_threads
        _live_engine = self
        # Which vLLM module each HF tensor name lands in (several for fused q/k/v and gate/up).
        self._hf_names_by_module: dict[str, list[str]] = {}
        for worker_modules in self.llm.collective_rpc(worker_ops.hf_names_by_module):
            self._hf_names_by_module.update(worker_modules)
        self._module_of = {name: module for module, names in self._hf_names_by_module.items() for name in names}
        # Parts of modules whose other parts have not arrived yet (a sync may stream buckets).
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        # Modules whose weights are not usable, and why: discarded by sleep(level=2) or a failed load.
        self._stale: set[str] = set()
        self._stale_reason = ""
        self._asleep = False

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order, with the log-prob of every sampled token."""
        self._check_ready()
        self._check_prompts("prompt_token_ids", prompt_token_ids)
        check_sampling_params(params, self.llm.llm_engine.model_config.get_vocab_size())
        if not prompt_token_ids:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # vLLM refuses n > 1 with greedy sampling: it samples one completion, which stands for all n.
        copies = params.n if params.greedy else 1
        with _refusals_as_value_errors():
            vllm_params = VLLMSamplingParams(
                n=1 if params.greedy else params.n,
                max_tokens=params.max_tokens,
                min_tokens=params.min_tokens,
                temperature=0.0 if params.greedy else params.temperature,  # greedy as the native engine's
                top_p=params.top_p,
                top_k=params.top_k if params.top_k_enabled else 0,
                stop=list(params.stop) or None,
                stop_token_ids=list(params.stop_token_ids) or None,
                ignore_eos=params.ignore_eos,
                seed=_vllm_seed(params.seed),
                # 0: the sampled token's own log-prob and no alternatives.
                logprobs=0 if params.logprobs else None,
                include_stop_str_in_output=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], vllm_params, use_tqdm=False
            )
        return [
            [_completion(c, params.logprobs) for c in sorted(o.outputs, key=lambda c: c.index) for _ in range(copies)]
            for o in outputs
        ]

    def prompt_logprobs(self, token_ids: list[list[int]], top_k: int) -> list[PromptLogProbs]:
        """Score each sequence's own tokens (all but the first) in one prefill, with ``top_k`` alternatives."""
        self._check_ready()
        self._check_prompts("token_ids", token_ids)
        model_config = self.llm.llm_engine.model_config
        # -1 is vLLM's "no cap": as many as the vocabulary has.
        max_logprobs = model_config.max_logprobs if model_config.max_logprobs != -1 else model_config.get_vocab_size()
        if not 0 <= top_k <= max_logprobs:
            raise ValueError(f"top_k must be in [0, {max_logprobs}] (vllm_config.max_logprobs), got {top_k}")
        if not token_ids:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # One greedy token is the least vLLM generates; the prompt log-probs are the output.
        vllm_params = VLLMSamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=top_k,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        with _refusals_as_value_errors():
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in token_ids], vllm_params, use_tqdm=False
            )
        return [_prompt_logprobs(list(ids), o.prompt_logprobs, top_k) for ids, o in zip(token_ids, outputs)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace parameters by HF name, then reset the prefix cache (its KV came from the old weights).

        A sync may call this once per bucket. vLLM rebuilds a module from what
        one reload brings, so a module's tensors (all of q/k/v or gate/up where
        vLLM fuses them, weight and bias) go to vLLM together: parts that
        arrive before the rest are held back, copied, since a sync may reuse
        its bucket buffers. Until the rest arrives, generation refuses to run.
        """
        ready, arrived = [], {}
        for name, tensor in weights:
            module = self._module_of.get(name)
            if module is None:
                ready.append((name, tensor))  # vLLM's loader knows it (e.g. a tied lm_head) or names it in an error
            else:
                arrived.setdefault(module, {})[name] = tensor
        for module, parts in arrived.items():
            parts = {**self._pending.pop(module, {}), **parts}
            if parts.keys() >= set(self._hf_names_by_module[module]):
                ready.extend(parts.items())
            else:
                self._pending[module] = {name: tensor.clone() for name, tensor in parts.items()}
        if not ready:
            return
        loaded = {self._module_of[name] for name, _ in ready if name in self._module_of}
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ready})
        except Exception:
            self._mark_stale("the last load_weights failed part way; load the full set of weights again")
            raise
        self._stale -= loaded
        if not self._asleep:  # asleep, there is no cached KV: sleep cleared the prefix cache
            self.reset_prefix_cache()

    def weight_norm(self) -> float:
        """L2 norm of the weights decoding uses, in float64, comparable with the HF model's."""
        self._check_ready()
        return math.sqrt(sum(self.llm.collective_rpc(worker_ops.sum_of_squares)))

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache: requests were still running")

    def sleep(self, level: int) -> dict:
        """Free device memory through vLLM sleep mode (CUDA only).

        vLLM's level 1 discards the KV cache and offloads weights to CPU
        memory; level 2 discards both, so ``load_weights`` must follow the
        wake-up. Both clear the prefix cache.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free KV cache, offload weights) or 2 (free both), got {level}")
        if not self._sleep_supported:
            return {"slept": False, "reason": SLEEP_NEEDS_CUDA}
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=level)
        self._asleep = True
        if level == 2:
            self._mark_stale("sleep(level=2) discarded them; load_weights after wake")
        return {
            "slept": True,
            "level": level,
            "kv_cache": "discarded",
            "weights": "offloaded to CPU" if level == 1 else "discarded",
            "freed_bytes": torch.cuda.mem_get_info()[0] - free_before,
        }

    def wake(self, tags: list[str] | None = None) -> dict:
        """Restore what ``sleep`` freed; ``tags`` ("weights", "kv_cache") limits it, e.g. weights first for a sync."""
        allowed = {"weights", "kv_cache"}
        if tags is not None and not set(tags) <= allowed:
            raise ValueError(f"wake tags must be a subset of {sorted(allowed)}, got {tags}")
        if not self._sleep_supported:
            return {"woke": False, "reason": SLEEP_NEEDS_CUDA}
        self.llm.wake_up(tags=tags)
        self._asleep = bool(self.llm.llm_engine.is_sleeping())
        return {"woke": True, "tags": sorted(tags) if tags is not None else sorted(allowed), "asleep": self._asleep}

    def shutdown(self) -> None:
        """Stop the engine, its process groups with it, and release its memory (mostly the KV cache)."""
        global _live_engine
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        _live_engine = None

    @property
    def _sleep_supported(self) -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_sleep_mode_available() and self.llm.llm_engine.model_config.enable_sleep_mode

    def _mark_stale(self, reason: str) -> None:
        self._stale = set(self._hf_names_by_module)
        self._stale_reason = reason

    def _check_prompts(self, field: str, prompt_token_ids: list[list[int]]) -> None:
        model_config = self.llm.llm_engine.model_config
        max_len, vocab = model_config.max_model_len, model_config.get_vocab_size()
        for i, ids in enumerate(prompt_token_ids):
            check_prompt(ids, max_len, vocab, f"{field}[{i}]")

    def _check_ready(self) -> None:
        if not hasattr(self, "llm"):
            raise RuntimeError("the vLLM engine was shut down")
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep; wake it first")
        if self._stale:
            raise RuntimeError(
                f"the vLLM engine has no usable weights for {len(self._stale)} modules (e.g. {min(self._stale)}): "
                f"{self._stale_reason}"
            )
        if self._pending:
            module, parts = next(iter(self._pending.items()))
            missing = sorted(set(self._hf_names_by_module[module]) - parts.keys())
            raise RuntimeError(
                f"load_weights is incomplete: {module} got {sorted(parts)} and still needs {missing} "
                "(vLLM loads a fused module's parts together)"
            )


def _vllm_seed(seed: int | None) -> int | None:
    """Our seed as vLLM's, whose completion i draws from ``seed + i``; -1 means unseeded to it, 2**64 overflows.

    Spread by an odd 64-bit multiplier and kept below 2**63, any integer is a
    valid seed and neighbouring seeds share no completion (without it, seed
    s's completion 1 is seed s+1's completion 0).
    """
    if seed is None:
        return None
    return (seed * _SEED_MULTIPLIER) % 2**63


@contextlib.contextmanager
def _refusals_as_value_errors():
    """vLLM's ``VLLMValidationError`` is no ``ValueError``; as one, the server answers 400 (the request), not 500."""
    from vllm.exceptions import VLLMValidationError

    try:
        yield
    except VLLMValidationError as error:
        field = f"sampling_params.{error.parameter}={error.value!r}: " if error.parameter else ""
        raise ValueError(f"{field}vLLM refused the request: {error.args[0]}") from error


def _completion(output, with_logprobs: bool) -> Completion:
    if output.finish_reason not in ("stop", "length", "abort"):
        raise RuntimeError(f"vLLM finished a completion with an unknown reason {output.finish_reason!r}")
    token_ids = list(output.token_ids)
    logprobs = [step[token].logprob for token, step in zip(token_ids, output.logprobs)] if with_logprobs else []
    return Completion(
        token_ids=token_ids,
        text=output.text,
        finish_reason=output.finish_reason,
        logprobs=logprobs,
        stop_reason=output.stop_reason,
    )


def _prompt_logprobs(token_ids: list[int], positions, top_k: int) -> PromptLogProbs:
    # vLLM gives one dict per prompt position (None for the first): the
    # position's own token plus the top_k best, each with its rank.
    scored = token_ids[1:]
    logprobs, top = [], []
    for token, candidates in zip(scored, positions[1:]):
        logprobs.append(candidates[token].logprob)
        best = sorted((c.rank, token_id, c.logprob) for token_id, c in candidates.items() if c.rank <= top_k)
        top.append([(token_id, logprob) for _, token_id, logprob in best[:top_k]])
    return PromptLogProbs(token_ids=scored, logprobs=logprobs, top_logprobs=top)
