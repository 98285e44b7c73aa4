"""Hydra configs the recipes share; recipe configs find them with ``hydra.searchpath: [pkg://recipes.conf]``."""
