"""`lorazor serve`: an OpenAI-compatible HTTP server over a LoRazorEngine (FastAPI + uvicorn)."""

from .app import build_app

__all__ = ["build_app"]
