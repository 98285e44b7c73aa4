"""Tests of the SkyRL integration (``arctic_rl_skyrl``).

They run in the integration's Python 3.12 environment, which
``integrations/arctic_rl_skyrl/install_env.sh`` builds:

    .venv-skyrl/bin/pytest tests/skyrl

Anywhere else (the main suite on Python 3.11, where skyrl 0.4 does not
install) this directory is not collected, so it neither fails nor imports skyrl.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

SKYRL_ENVIRONMENT = sys.version_info >= (3, 12) and importlib.util.find_spec("skyrl") is not None

if not SKYRL_ENVIRONMENT:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/skyrl/" in item.nodeid:
            item.add_marker(pytest.mark.skyrl)
