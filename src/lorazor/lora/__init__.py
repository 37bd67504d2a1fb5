"""The batched LoRA layers: `BatchedLoRALinear` (every row its own adapter), the merged q/k/v and
gate/up projections, and the step context they read. Below the runner: nothing here imports it."""

from .context import StepContext
from .layers import BatchedLoRALinear, patch_layers, unpatch_layers
from .merged import merge_projections

__all__ = ["BatchedLoRALinear", "StepContext", "merge_projections", "patch_layers", "unpatch_layers"]
