"""`lorazor serve`: an OpenAI-compatible HTTP server over a LoRazorEngine (FastAPI + uvicorn).

`build_app` is imported on first use, so `lorazor --help` and the other commands work without the
`serve` extra installed.
"""

__all__ = ["build_app"]


def __getattr__(name):
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(name)
