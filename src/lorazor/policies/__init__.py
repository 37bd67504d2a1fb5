"""StepTrim release policies: when a request stops using its adapter, for good."""

from .base import NEVER, ReleasePolicy, ReleaseState
from .learned import LearnedRelease
from .io import load_release_policy, save_release_policy
from .profiled import ProfiledRelease

__all__ = [
    "NEVER", "LearnedRelease", "ProfiledRelease", "ReleasePolicy", "ReleaseState", "load_release_policy",
    "save_release_policy",
]
