"""Model definitions and their arithmetic. One family for now: a Llama-style decoder
(llama), with mixture-of-experts blocks (moe). Never imports partrain.parallel."""
