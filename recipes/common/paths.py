"""Where recipes look for local copies of datasets.

A checkout keeps real data next to the repository (``<repo>/../shared/data``),
which is also where CI places it. ``ARCTIC_RL_DATA_DIR`` points elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "ARCTIC_RL_DATA_DIR"

REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_data_dir(name: str) -> Path:
    """The local copy of dataset ``name``: ``$ARCTIC_RL_DATA_DIR/<name>``, else ``<repo>/../shared/data/<name>``."""
    root = os.environ.get(DATA_DIR_ENV)
    base = Path(root).expanduser() if root else REPO_ROOT.parent / "shared" / "data"
    return base / name
