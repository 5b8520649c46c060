"""The wire: OpenAI-compatible and session endpoints (FastAPI), request/response models."""
