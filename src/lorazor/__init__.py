"""LoRazor: serve many LoRA adapters on one Hugging Face backbone, in one batch, fast.

The public names are imported on first use (PEP 562), so `lorazor --version`, `--help` and the
command line's argument errors answer without importing torch and transformers.
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0.dev0"

if TYPE_CHECKING:  # what type checkers and the API docs (static analysis) read as the public names
    from .adapters import AdapterBank, AdapterError
    from .config import LoRazorConfig
    from .engine import LoRazorEngine, RequestOutput
    from .model import LoRazorModel, LoRazorOutput, ModelBusyError, ModelClosedError
    from .policies import LearnedRelease, ProfiledRelease, ReleasePolicy, load_release_policy, save_release_policy

# Public name -> the module that defines it.
_PUBLIC = {
    "AdapterBank": ".adapters", "AdapterError": ".adapters", "LoRazorConfig": ".config",
    "LoRazorEngine": ".engine", "RequestOutput": ".engine", "LoRazorModel": ".model", "LoRazorOutput": ".model",
    "ModelBusyError": ".model", "ModelClosedError": ".model", "LearnedRelease": ".policies",
    "ProfiledRelease": ".policies", "ReleasePolicy": ".policies", "load_release_policy": ".policies",
    "save_release_policy": ".policies",
}

__all__ = [
    "AdapterBank",
    "AdapterError",
    "LearnedRelease",
    "LoRazorConfig",
    "LoRazorEngine",
    "LoRazorModel",
    "LoRazorOutput",
    "ModelBusyError",
    "ModelClosedError",
    "ProfiledRelease",
    "ReleasePolicy",
    "RequestOutput",
    "load_release_policy",
    "save_release_policy",
]


def _lazy_getattr(module: str, public: dict):
    """A PEP 562 `__getattr__` for package `module` that imports each of its `public` names (name ->
    the submodule defining it) on first use and keeps it in the package (later lookups find it
    directly). `lorazor`, `lorazor.adapters` and `lorazor.engine` use it."""
    namespace = importlib.import_module(module).__dict__

    def __getattr__(name):
        if name in public:
            value = namespace[name] = getattr(importlib.import_module(public[name], module), name)
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = _lazy_getattr(__name__, _PUBLIC)


def __dir__():
    return sorted([*globals(), *_PUBLIC])
