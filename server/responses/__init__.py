"""OpenAI's Responses API: schema, its router and adapter, stored responses."""
