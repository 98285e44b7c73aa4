"""The two ways a weight sync fails, so callers can tell a refused sync from a broken transport."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A sync could not complete: a peer died, timed out, or a transport failed. The message names the step."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"weight sync failed at step {step!r}: {detail}")
        self.step = step
        self.detail = detail


class WeightMismatchError(WeightSyncError):
    """The receiver refused the sync before loading anything: names or shapes differ from what it expects."""
