"""Shared fixtures: a tiny real model built on the spot, and free ports."""

from __future__ import annotations

import os
import socket

import pytest

# Ray must never attach a test to another process's cluster.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer Qwen2 with a locally trained tokenizer (head dim 64)."""
    from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", TinySpec(family="qwen2")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True, scope="module")
def _vllm_leaves_the_environment_as_found(request):
    """An in-process vLLM engine sets process-wide variables (LD_PRELOAD, LOCAL_WORLD_SIZE, VLLM_DIST_IDENT,
    ...) that servers started later by the same pytest process would inherit; their vLLM workers then fail."""
    if request.node.get_closest_marker("vllm") is None:
        yield
        return
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
