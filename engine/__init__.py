"""MLX side: model loading, KV segments, scheduling, batched prefill/decode, sampling."""
