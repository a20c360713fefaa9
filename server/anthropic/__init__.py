"""Anthropic's Messages API: schema, its router and adapter."""
