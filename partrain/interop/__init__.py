"""A checkpoint and the outside world: Hugging Face import and export (hf), text generation
(sample)."""
