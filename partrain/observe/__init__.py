"""What a run reports: metrics.jsonl and the progress display (metrics), TensorBoard and W&B
curves (curves), the step trace (trace), measured memory (memory)."""
