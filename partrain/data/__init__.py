"""Tokens in, the same global batch for every layout out: the embedded stdlib corpus or a token
dir from `partrain data prepare` (tokens, prepare, tokenizer), which sequences each step reads
(sampler: random windows, epochs, weighted blends of token dirs) and the batches cut from them
(batches). The global batch of step s depends only on the seed and s; dp rank r takes its slice."""
