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


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value  # once: later lookups find it directly
        return value
    raise AttributeError(f"module 'lorazor' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PUBLIC])
