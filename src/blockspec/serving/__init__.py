"""OpenAI-compatible serving on the batching engine.

    from blockspec.serving import create_app, ServerLimits

`blockspec serve` (serving.server) loads the models and runs the app with uvicorn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerLimits", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: FastAPI is the optional `serve` extra; the CLI imports serving.server to build
    # its parser, which must work without it.
    if name in __all__:
        from blockspec.serving import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
