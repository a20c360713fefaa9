"""The prefill-only endpoints: /v1/embeddings, /v1/rerank and /v1/classify."""
