"""The GPU tests share one process: each starts with the garbage of the tests before it collected."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _collect_earlier_tests_garbage():
    """Engines and CUDA graphs keep reference cycles. Collected in the middle of a later test, they would change
    the memory it measures (a sync's ``memory_allocated() == before``); alive, they hold device memory it needs."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    yield
