"""verl 0.9.1 with arctic-rl as its training engine and sampler, as a plugin: no patch to verl.

    python -m verl.trainer.main_ppo \\
        hydra.searchpath=[pkg://arctic_rl_verl.conf] model_engine=arctic \\
        actor_rollout_ref.actor.strategy=arctic actor_rollout_ref.rollout.name=arctic ...

- ``plugin``: what ``import verl`` registers (entry point ``verl.plugins``).
- ``conf``: the ``model_engine=arctic`` Hydra group (actor, reference, critic).
- ``config``: its dataclasses; the arctic settings live in ``actor_rollout_ref.actor.arctic``.
- ``mapping``: verl's loss, optimizer and run settings in arctic-rl's terms; what is refused.
- ``engine``: the verl engine that calls arctic-rl (fwd_bwd, step, fwd_no_grad, ...).
- ``rollout``, ``rollout_server``: verl's rollout served by arctic-rl's sampler.
- ``session``: the arctic-rl client a verl worker process drives.
- ``batch``: verl's jagged batches to arctic-rl's padded, shifted ones and back.
- ``cpu_platform``: verl's workers on a CPU-only host.
"""
