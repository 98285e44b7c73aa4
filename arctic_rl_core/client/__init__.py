"""Clients: ``create_arctic_rl_client(config)`` returns an ArcticRLHTTPClient or ArcticRLRayClient."""

from arctic_rl_core.client.base import ArcticRLClient
from arctic_rl_core.client.factory import create_arctic_rl_client
from arctic_rl_core.client.http import ArcticRLHTTPClient, ArcticRLRequestError
from arctic_rl_core.client.ray import ArcticRLRayClient

__all__ = [
    "ArcticRLClient",
    "ArcticRLHTTPClient",
    "ArcticRLRayClient",
    "ArcticRLRequestError",
    "create_arctic_rl_client",
]
