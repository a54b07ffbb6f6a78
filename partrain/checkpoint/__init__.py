"""Checkpoints: one format for every layout (state.py), the commit protocol on disk (store.py),
saving during training (checkpointer.py) and what a resume may change (resume.py)."""
