"""One completion being generated: its tokens, its KV blocks and where it stands."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

from arctic_rl_core.engines.sampling.native.detokenizer import IncrementalDetokenizer
from arctic_rl_core.engines.sampling.protocol import SamplingParams

PENDING = -1  # the token of a decode step still on the device (asynchronous scheduling)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Prompt plus generated tokens of completion ``index`` of request ``request_id``.

    ``block_table`` belongs to the block manager, which alone changes it.
    ``noise_key`` (from the completion's seed) drives its sampling noise, so
    its tokens do not depend on what else shares the batch.
    """

    _ids = count()

    def __init__(
        self,
        request_id,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        noise_key: int,
        block_size: int,
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.noise_key = noise_key
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.allocations = 0  # times the block manager has allocated this sequence (preemption reallocates)
        self.num_cached_tokens = 0
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text_end: int | None = None  # where a stop string starts in ``detokenizer.text``
        # The completion's text as it grows, for stop strings (only completions that have some).
        self.detokenizer = IncrementalDetokenizer(self.num_prompt_tokens) if params.stop else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)

    @property
    def has_pending_token(self) -> bool:
        return self.token_ids[-1] == PENDING

    def append_pending(self) -> None:
        """Count the token a launched decode step is sampling; ``resolve_pending`` fills it in."""
        self.append(PENDING, 0.0)

    def resolve_pending(self, token_id: int, logprob: float) -> None:
        self.token_ids[-1] = token_id
        self.logprobs[-1] = logprob
