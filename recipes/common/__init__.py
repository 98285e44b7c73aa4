"""Pieces every recipe shares: row format, file writing, data paths, tag extraction, reward adapters."""
