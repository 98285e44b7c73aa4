"""The native sampling engine: nano-vllm's shape, with prefix caching and Forest Cascade Attention.

One noun per module: ``sequence``, ``block_manager``, ``scheduler``,
``model_runner``, ``sampler``, ``engine`` (the loop and the sampling protocol);
the model itself in ``model`` / ``weights`` / ``ops`` / ``attention``.
"""

from arctic_rl_core.engines.sampling.native.engine import NativeEngine, RequestOutput

__all__ = ["NativeEngine", "RequestOutput"]
