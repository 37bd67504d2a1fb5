"""LoRazor: serve many LoRA adapters on one Hugging Face backbone, in one batch, fast."""

from .adapters import AdapterBank, AdapterError
from .config import LoRazorConfig
from .engine import LoRazorEngine, RequestOutput
from .model import LoRazorModel, LoRazorOutput, ModelBusyError, ModelClosedError
from .policies import LearnedRelease, ProfiledRelease, ReleasePolicy, load_release_policy, save_release_policy

__version__ = "0.2.0.dev0"

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
