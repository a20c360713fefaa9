"""HTTP side: OpenAI-compatible FastAPI app and the radix-mlx CLI."""
