"""Ollama's native API: schema, adapter and routes."""
