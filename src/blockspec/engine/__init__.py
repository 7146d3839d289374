"""The continuous-batching engine runtime (docs/design.md section 12), between the
decoding round below and serving / the bench above: the request queue and its thread
(engine.py), the KV slot pool (slots.py), chunked prefill (prefill_chunks.py), the
memory plan (memory.py), request handles (handles.py) and statistics (stats.py)."""

from blockspec.engine.engine import Engine, EngineOptions
from blockspec.engine.handles import RequestHandle, RequestOutput

__all__ = ["Engine", "EngineOptions", "RequestHandle", "RequestOutput"]
