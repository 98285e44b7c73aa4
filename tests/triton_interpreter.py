"""Triton kernels checked on CPU by Triton's interpreter.

Triton picks interpreter or compiler when it is first imported, so a test
module's checks run in a fresh Python with ``TRITON_INTERPRET=1``: the module
runs as a script, its ``__main__`` calls ``report(CHECKS)``, and each test reads
its check's result from ``run_interpreted(__file__)`` (``check_test`` makes
one test case per check of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

Checks = Mapping[str, tuple[Callable[..., None], tuple]]


def run_interpreted(script: str) -> dict[str, str]:
    """Run ``script``'s checks under the interpreter: each check's name, mapped to "ok" or its traceback."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(checks: Checks) -> None:
    """Run every check, and print their outcomes as one JSON line for ``run_interpreted``."""
    results = {}
    for name, (check, args) in checks.items():
        try:
            check(*args)
            results[name] = "ok"
        except Exception:  # a failed check is reported by its test, with its traceback
            results[name] = traceback.format_exc()
    print(json.dumps(results))


def check_test(script: str, checks: Checks):
    """A test with one case per check of ``script``, all run once, in one interpreted Python, on first use.

    Assign it to a ``test_`` name in the module: ``test_x = check_test(__file__, CHECKS)``.
    """
    results: dict[str, str] = {}

    @pytest.mark.parametrize("name", list(checks))
    def test(name):
        if not results:
            results.update(run_interpreted(script))
        assert results[name] == "ok", results[name]

    return test
