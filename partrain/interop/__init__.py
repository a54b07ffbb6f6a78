"""A checkpoint and the outside world: Hugging Face import and export (hf), text generation
(sample), and the finiteness of weights read from outside a run (finite)."""
