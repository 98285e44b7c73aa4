"""The verl plugin: ``import verl`` loads this module (entry point group ``verl.plugins``) in every process.

It registers, in this order:

1. the ``cpu`` platform (``cpu_platform``), before anything asks verl for its
   device: some verl modules read it at import time;
2. the ``arctic`` training engine (``EngineRegistry``, strategy ``arctic``);
3. the ``arctic`` rollout: the replica (``RolloutReplicaRegistry``) and the
   worker-side rollout class. verl 0.9.1 offers no register function for the
   latter, so it is added to ``verl.workers.rollout.base._ROLLOUT_REGISTRY``,
   the table ``get_rollout_class`` reads.

Without the entry point (a source checkout that is not installed), set
``VERL_USE_EXTERNAL_MODULES=arctic_rl_verl.plugin``.
"""

from __future__ import annotations

from arctic_rl_verl.cpu_platform import cpu_platform_active, install_gloo_process_group, register_cpu_platform


def _load_replica():
    from arctic_rl_verl.rollout_server import ArcticReplica

    return ArcticReplica


def register() -> None:
    register_cpu_platform()
    if cpu_platform_active():
        install_gloo_process_group()

    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import arctic_rl_verl.engine  # noqa: F401 - registers the engine with EngineRegistry
    from arctic_rl_verl.rollout import ROLLOUT_NAME

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "arctic_rl_verl.rollout.ArcticRollout"


register()
