"""The GPU tests share one process: each starts with the garbage of the tests before it collected."""

import pytest

from arctic_rl_core.engines.runtime import empty_device_cache


@pytest.fixture(autouse=True)
def _collect_earlier_tests_garbage():
    """Engines and CUDA graphs keep reference cycles. Collected in the middle of a later test, they would change
    the memory it measures (a sync's ``memory_allocated() == before``); alive, they hold device memory it needs.
    Their cached segments and cuBLAS's workspaces go back too, so each test starts as it would alone."""
    empty_device_cache()
    yield
