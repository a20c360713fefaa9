"""LM Studio's own REST API under /api/v0 (server/lmstudio/routes.py)."""
