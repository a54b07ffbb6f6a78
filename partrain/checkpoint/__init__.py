"""Checkpoints: one format for every layout (state.py), the commit protocol on disk (store.py),
saving during training (checkpointer.py), what a resume may change (resume.py) and a checkpoint's
model on one process (offline.py). Never imports partrain.interop or partrain.launch."""
