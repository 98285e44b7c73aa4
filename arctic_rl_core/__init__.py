"""arctic-rl: an RL compute engine for LLM post-training.

    from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client

Names resolve lazily, so engine-side modules (processors, zorro, weight_sync)
import without pulling in the client's Ray and HTTP stacks.
"""

from importlib import import_module

_EXPORTS = {
    "ArcticRLClientConfig": "arctic_rl_core.config",
    "WeightSyncConfig": "arctic_rl_core.config",
    "ArcticRLClient": "arctic_rl_core.client",
    "ArcticRLHTTPClient": "arctic_rl_core.client",
    "ArcticRLRayClient": "arctic_rl_core.client",
    "create_arctic_rl_client": "arctic_rl_core.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'arctic_rl_core' has no attribute {name!r}")
