"""OpenAI's Chat Completions, Completions and Models APIs: schema, adapter, formats, routes."""
