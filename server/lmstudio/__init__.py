"""LM Studio's own REST API: v0 under /api/v0 (routes.py), v1's model management under
/api/v1 (v1.py), both in its shapes (protocol.py) and words for a model (models.py)."""
