"""One worker, read top to bottom: `python -m partrain.train RUN_DIR` (see __main__)."""
