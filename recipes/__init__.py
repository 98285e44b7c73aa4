"""End-to-end RL recipes: data preparation and rule rewards shared by every framework launcher.

Each task (``gsm8k``, ``txt2sql``, ``long_context_qa``) has ``data.py`` (writes
verl-format parquet and JSONL) and ``reward.py`` (``compute_score`` with verl's
custom reward signature). ``common`` holds what the tasks share.
"""
