"""arctic-rl: an RL compute engine for LLM post-training.

    from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
"""

from arctic_rl_core.client import ArcticRLClient, ArcticRLHTTPClient, ArcticRLRayClient, create_arctic_rl_client
from arctic_rl_core.config import ArcticRLClientConfig, WeightSyncConfig

__all__ = [
    "ArcticRLClient",
    "ArcticRLClientConfig",
    "ArcticRLHTTPClient",
    "ArcticRLRayClient",
    "WeightSyncConfig",
    "create_arctic_rl_client",
]
