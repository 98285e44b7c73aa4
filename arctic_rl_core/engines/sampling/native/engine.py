"""The native sampling engine: ``add_request`` / ``step`` for continuous batching, and the sampling protocol.

``step()`` is the whole engine loop: ``scheduler.schedule()`` ->
``model_runner.run(batch)`` -> append tokens and finish what stopped.

Asynchronous scheduling (on by default): while a decode batch runs
unchanged, each step launches the next one before reading the last one's
tokens, which the device feeds itself as the next inputs. The host's
bookkeeping, stop checks and scheduling then overlap the device's work
instead of leaving it idle between steps. A sequence that stops on a token
(EOS, a stop string) has had one more step launched for it; that step's token
is dropped, so outputs are those of the synchronous loop. Any change to the
batch (a finish, a new request, an abort) first completes the step in flight.

Threads: ``add_request`` and ``abort_request`` may be called from any thread
(they only queue work); everything else, ``step`` and ``generate`` included,
must be called from one thread, the engine's. A worker serving concurrent
callers adds each caller's request and lets one loop call ``step()`` while
``has_unfinished()``, handing each finished ``RequestOutput`` to the caller
that owns its ``request_id``. Requests added between steps join the running
batch at the next step.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import threading
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from arctic_rl_core.engines.runtime import empty_device_cache
from arctic_rl_core.engines.sampling.native.block_manager import BlockManager
from arctic_rl_core.engines.sampling.native.config import EngineConfig
from arctic_rl_core.engines.sampling.native.detokenizer import INCOMPLETE, decode
from arctic_rl_core.engines.sampling.native.model_runner import ModelRunner
from arctic_rl_core.engines.sampling.native.sampler import SampledTokens, noise_key
from arctic_rl_core.engines.sampling.native.scheduler import Batch, Scheduler
from arctic_rl_core.engines.sampling.native.sequence import Sequence
from arctic_rl_core.engines.sampling.native.weights import WeightLoader, iter_checkpoint
from arctic_rl_core.engines.sampling.protocol import (
    Completion,
    SamplingEngineOptions,
    SamplingParams,
    check_prompt,
    check_sampling_params,
)

SLEEP_TAGS = ("weights", "kv_cache")
_SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct seeds for a request's n completions


@dataclass
class RequestOutput:
    request_id: Hashable
    completions: list[Completion]


@dataclass
class _Request:
    request_id: Hashable
    seqs: list[Sequence]


@dataclass
class _LaunchedStep:
    """A step on the device whose tokens have not been read yet."""

    batch: Batch
    sampled: SampledTokens


class NativeEngine:
    """A paged-KV, continuously batching sampler with prefix caching and Forest Cascade Attention."""

    def __init__(self, model_path: str, options: SamplingEngineOptions):
        config = EngineConfig.from_options(model_path, options)
        self.tokenizer = _load_tokenizer(model_path)
        # As in vLLM: the tokenizer's EOS is the primary one; generation_config's EOS ids are added to it.
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if self.eos_token_id is not None:
            config = dataclasses.replace(config, eos_token_ids=config.eos_token_ids | {self.eos_token_id})
        self.config = config
        self.eos_token_ids = config.eos_token_ids
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)  # fmt: skip
        self.scheduler = Scheduler(self.config, self.block_manager)
        self._rng = random.Random(self.config.seed)
        self._inbox: deque[tuple[str, object]] = deque()
        self._lock = threading.Lock()
        self._requests: dict[Hashable, _Request] = {}
        self._undelivered: list[RequestOutput] = []
        self._auto_ids = itertools.count()
        self._asleep: set[str] = set()
        self._loader: WeightLoader | None = None  # made at the first load; its views follow the weights
        self._launched: _LaunchedStep | None = None  # a decode step launched ahead (asynchronous scheduling)

    # ---- engine loop ----------------------------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: Hashable | None = None
    ) -> Hashable:
        """Queue ``params.n`` completions of one prompt; returns the request id (generated when None)."""
        self._require_awake()
        self._check_prompt(prompt_token_ids)
        check_sampling_params(params, self.config.spec.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer, and {self.config.model_path!r} has none")
        with self._lock:
            if request_id is None:
                request_id = f"native-{next(self._auto_ids)}"
            if request_id in self._requests or any(op == "add" and arg[0] == request_id for op, arg in self._inbox):
                raise ValueError(f"request_id={request_id!r} is already in flight")
            self._inbox.append(("add", (request_id, list(prompt_token_ids), params)))
        return request_id

    def abort_request(self, request_id: Hashable) -> None:
        """Stop a request; its sequences free their blocks at the next step and nothing is returned for it."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self._undelivered or self.scheduler.has_unfinished() or self._launched)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the requests that finished (and any finished during ``generate``)."""
        outputs, self._undelivered = self._undelivered, []
        return outputs + self._step()

    def _step(self) -> list[RequestOutput]:
        self._require_awake()
        launched, self._launched = self._launched, None
        if launched is not None and not self._inbox and self._continues(launched.batch):
            try:
                batch = self.scheduler.schedule()
                if [s.seq_id for s in batch.seqs] != [s.seq_id for s in launched.batch.seqs]:
                    raise RuntimeError("asynchronous scheduling expected the same decode batch again")
                # The next step goes to the device before this one's tokens are read: they are its inputs there.
                step = _LaunchedStep(batch, self.runner.run(batch, previous=launched.sampled))
            except BaseException:
                self._launched = launched  # still to be read; the caller's aborts come after it
                raise
            outputs = self._complete(launched, next_step_launched=True)
            running = [s for s in batch.seqs if not s.is_finished]
            if running:
                self._leave_in_flight(step, running)
            else:
                step.sampled.values()  # every sequence stopped: nothing to read, but leave the device idle
            return outputs
        outputs = self._complete(launched) if launched is not None else []
        self._drain_inbox()
        if not self.scheduler.has_unfinished():
            return outputs
        batch = self.scheduler.schedule()
        step = _LaunchedStep(batch, self.runner.run(batch))
        if batch.is_prefill or not self.config.async_scheduling:
            return outputs + self._complete(step)
        self._leave_in_flight(step, batch.seqs)
        return outputs

    def _leave_in_flight(self, step: _LaunchedStep, seqs: list[Sequence]) -> None:
        """Keep ``step`` on the device, unread; ``seqs`` count the token it is sampling for them."""
        for seq in seqs:
            seq.append_pending()
        self._launched = step

    def _continues(self, batch: Batch) -> bool:
        """Whether the next step is this decode batch again, one token on, whatever its pending tokens are.

        Then its inputs can stay on the device. Not when requests wait, a
        pending token ends a sequence by length, or blocks would run out.
        """
        running = self.scheduler.running
        if batch.is_prefill or self.scheduler.waiting or len(running) != len(batch.seqs):
            return False
        new_blocks = 0
        for queued, seq in zip(running, batch.seqs):
            if queued is not seq:
                return False
            if self._reached_length(seq):
                return False
            new_blocks += len(seq.block_table) < seq.num_blocks
        return new_blocks <= self.block_manager.num_free_blocks

    def _complete(self, step: _LaunchedStep, next_step_launched: bool = False) -> list[RequestOutput]:
        """Read a step's tokens: append them (or fill in the pending ones) and finish what stopped.

        A pending token's block is registered here only when ``next_step_launched``:
        that step writes the token's KV before any later request can read it.
        Otherwise the KV is not computed yet, and ``may_append`` registers the
        block when the decode step that computes it is scheduled.
        """
        tokens, logprobs = step.sampled.values()
        finished = []
        for seq, token, logprob in zip(step.batch.seqs, tokens, logprobs):
            if seq.is_finished:
                continue  # it stopped, or was aborted, while this step ran: the token is dropped
            pending = seq.has_pending_token
            if pending:
                seq.resolve_pending(token, logprob)
            else:
                seq.append(token, logprob)
            if self._stop(seq):
                finished.append(seq.request_id)
            elif pending and next_step_launched:
                self.block_manager.register_last_block(seq)  # scheduled before its token was known
        outputs = []
        for request_id in dict.fromkeys(finished):
            request = self._requests[request_id]
            if all(s.is_finished for s in request.seqs):
                del self._requests[request_id]
                outputs.append(RequestOutput(request_id, [self._completion(s) for s in request.seqs]))
        return outputs

    def _drain_inbox(self) -> None:
        with self._lock:
            work, self._inbox = list(self._inbox), deque()
        for op, arg in work:
            if op == "abort":
                if self._requests.pop(arg, None) is not None:
                    self.scheduler.abort(arg)
                continue
            request_id, prompt, params = arg
            seqs = [
                Sequence(
                    request_id, i, prompt, params, noise_key(self._completion_seed(params, i)), self.config.block_size
                )  # fmt: skip
                for i in range(params.n)
            ]
            self._requests[request_id] = _Request(request_id, seqs)
            for seq in seqs:
                self.scheduler.add(seq)

    def _completion_seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(64)
        return ((params.seed & (2**64 - 1)) * _SEED_MULTIPLIER + index) & (2**64 - 1)

    def _stop(self, seq: Sequence) -> bool:
        """Finish ``seq`` if its newest token ends it; True when it did."""
        p = seq.params
        token = seq.last_token
        # The text grows at every token, min_tokens or not: a stop string that ended before is not new.
        new_text = seq.detokenizer.extend(self.tokenizer, seq.token_ids) if p.stop else ""
        # As in vLLM: the first ``min_tokens`` tokens never end a completion (the sampler bans EOS and stop ids
        # there; a stop string ending in their text is ignored).
        if seq.num_completion_tokens > p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                # vLLM turns generation_config's other EOS ids into stop ids, so they are the stop_reason.
                self.scheduler.finish(seq, "stop", stop_reason=None if token == self.eos_token_id else token)
                return True
            if token in p.stop_token_ids:
                self.scheduler.finish(seq, "stop", stop_reason=token)
                return True
            if new_text:
                hit = self._find_stop_string(seq, new_text)
                if hit is not None:
                    seq.text_end, stop = hit
                    self.scheduler.finish(seq, "stop", stop_reason=stop)
                    return True
        if self._reached_length(seq):
            self.scheduler.finish(seq, "length")
            return True
        return False

    def _reached_length(self, seq: Sequence) -> bool:
        """Whether ``seq`` has its ``max_tokens`` or fills ``max_model_len`` (its pending token counted)."""
        return seq.num_completion_tokens >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len

    @staticmethod
    def _find_stop_string(seq: Sequence, new_text: str) -> tuple[int, str] | None:
        """The stop string that ``new_text``, the text the newest tokens added, completed: (text position, string).

        As vLLM picks: the one that ends first in the text, ties by list order.
        """
        text = seq.detokenizer.text
        previous = len(text) - len(new_text)
        # Only an occurrence that ends in the new text is new; one that ended earlier was seen (or ignored
        # before min_tokens) then. Searching from where a new one can start skips the old ones.
        best = None
        for stop in seq.params.stop:
            at = text.find(stop, max(0, previous - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best[0] + len(best[1])):
                best = (at, stop)
        return best

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return decode(self.tokenizer, token_ids)

    def _completion(self, seq: Sequence) -> Completion:
        token_ids = seq.completion_token_ids
        if seq.text_end is not None:
            text = seq.detokenizer.text[: seq.text_end]
        else:
            if seq.finish_reason == "stop":
                token_ids = token_ids[:-1]  # EOS or a stop id: in token_ids, not in the text (as vLLM returns it)
            text = self._decode(token_ids)
            # A tail of tokens whose text ends in U+FFFD may hold an incomplete UTF-8 sequence: vLLM's incremental
            # detokenizer holds such tokens back until a later one completes it, so a finished text lacks them.
            while text.endswith(INCOMPLETE):
                token_ids = token_ids[:-1]
                text = self._decode(token_ids)
        return Completion(
            token_ids=seq.completion_token_ids,
            text=text,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs else [],
            stop_reason=seq.stop_reason,
        )

    def _check_prompt(self, prompt: list[int]) -> None:
        check_prompt(prompt, self.config.max_model_len, self.config.spec.vocab_size)

    # ---- SamplingBackend ------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order; runs the engine loop until they are done.

        Other requests in flight advance too; their outputs are kept for the next ``step()``.
        """
        for prompt in prompt_token_ids:
            self._check_prompt(prompt)
        check_sampling_params(params, self.config.spec.vocab_size)
        ids = [self.add_request(prompt, params) for prompt in prompt_token_ids]
        pending = set(ids)
        results: dict[Hashable, list[Completion]] = {}
        try:
            while pending:
                for out in self._step():
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out.completions
                    else:
                        self._undelivered.append(out)
        except BaseException:
            for request_id in pending:
                self.abort_request(request_id)
            raise
        return [results[i] for i in ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | str | os.PathLike) -> None:
        """Copy HF-named tensors (any device: a CUDA-IPC bucket's views work) or a safetensors file/directory.

        The prefix cache is reset: its KV was computed by the old weights.
        """
        from_file = isinstance(weights, (str, os.PathLike))
        if from_file:
            weights = iter_checkpoint(weights, torch.device("cpu"))
        if self._loader is None:
            self._loader = WeightLoader(self.runner.model)
        with torch.no_grad():
            self._loader.load(weights, batched=not from_file)
        self.reset_prefix_cache()

    def weight_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for p in self.runner.model.parameters():
            total += torch.linalg.vector_norm(p, dtype=torch.float64).cpu() ** 2
        return float(total.sqrt())

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict:
        """Prompt tokens looked up in the prefix cache since start, and how many were hits."""
        return self.block_manager.stats.to_dict()

    def sleep(self, level: int) -> dict:
        """Level 1 frees the KV cache; level 2 also moves the weights off the GPU (to host memory)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r}; expected 1 or 2")
        if self.has_unfinished():
            raise RuntimeError("sleep() with requests in flight; finish or abort them first")
        freed = {}
        if "kv_cache" not in self._asleep:
            freed["kv_cache"] = self.runner.free_kv_cache()
            self._asleep.add("kv_cache")
        if level == 2 and "weights" not in self._asleep and self.config.device.type == "cuda":
            freed["weights"] = self.runner.move_weights(torch.device("cpu"))
            self._loader = None  # its destinations were the device copies
            self._asleep.add("weights")
        self.block_manager.reset_prefix_cache()
        if self.config.device.type == "cuda":
            empty_device_cache()  # the graphs are gone, so their pool and cuBLAS's workspaces can go too
        return {"level": level, "freed_bytes": freed}

    def wake(self, tags: list[str] | None = None) -> dict:
        """Restore what ``sleep`` freed: ``tags`` among "weights" and "kv_cache" (None: both)."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake tags {unknown} are unknown; expected a subset of {list(SLEEP_TAGS)}")
        restored = {}
        if "weights" in tags and "weights" in self._asleep:
            restored["weights"] = self.runner.move_weights(self.config.device)
            self._loader = None
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self.runner.allocate_kv_cache()
            restored["kv_cache"] = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
            self._asleep.discard("kv_cache")
        if not self._asleep and self.config.use_cuda_graphs and not self.runner.graphs:
            self.runner.capture_graphs()
        return {"restored_bytes": restored}

    def shutdown(self) -> None:
        if self._launched is not None:
            self._launched.sampled.values()  # the device may still be reading the cache freed below
            self._launched = None
        for request_id in list(self._requests):
            self.scheduler.abort(request_id)
        self._requests.clear()
        self.runner.free_kv_cache()
        self.runner.model = None
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()

    def _require_awake(self) -> None:
        if self._asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self._asleep)} freed); call wake() first")


def _load_tokenizer(model_path: str):
    """The model's tokenizer, or None when the checkpoint ships none (completions then carry ids only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
