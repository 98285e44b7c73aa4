"""Hydra configs of the arctic backend: ``hydra.searchpath=[pkg://arctic_rl_verl.conf] model_engine=arctic``."""
