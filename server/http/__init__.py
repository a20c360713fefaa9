"""HTTP plumbing every API shares: middleware, limits, auth, drain, errors, SSE."""
