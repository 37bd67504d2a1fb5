"""The serving engine: continuous batching over a LoRazorModel with a paged KV cache.

The server and the scripts take the engine's names from here, never from its modules. They are
imported on first use (PEP 562): a request body's schema can name `MAX_CACHE_SALT_CHARS` without
torch loading."""

from typing import TYPE_CHECKING

from .. import _lazy_getattr

if TYPE_CHECKING:  # what type checkers and the API docs read as the public names
    from .background import merge
    from .blocks import MAX_CACHE_SALT_CHARS
    from .engine import LoRazorEngine, check_engine_supports
    from .process import EngineDeadError, EngineProcess, ProcessHooks
    from .request import RequestOutput, TokenPrefix

# Public name -> the submodule that defines it.
_PUBLIC = {"LoRazorEngine": ".engine", "check_engine_supports": ".engine", "RequestOutput": ".request",
           "TokenPrefix": ".request", "merge": ".background", "MAX_CACHE_SALT_CHARS": ".blocks",
           "EngineProcess": ".process", "EngineDeadError": ".process", "ProcessHooks": ".process"}

__all__ = ["EngineDeadError", "EngineProcess", "LoRazorEngine", "MAX_CACHE_SALT_CHARS", "ProcessHooks", "RequestOutput",
           "TokenPrefix", "check_engine_supports", "merge"]


__getattr__ = _lazy_getattr(__name__, _PUBLIC)
