"""The model runner shared by `generate()` and the engine: forwards, LM head, LoRA step context, KV
caches, CUDA graphs and StepTrim decisions (see `runner.py`), and what the engine takes from it for
a step: the picks launched on the device and read back once (`launched.py`), the block tables it
uploads (`block_tables.py`), the grammar bitmasks (`grammar.py`), sampling on the device or the
host (`sampling.py`) and the StepTrim policies bound to the adapter slots (`release.py`). The
engine imports these names from here, never from the modules."""

from .block_tables import BlockTables
from .grammar import MaskBuffers, StructuredOutputError, apply_masks, grammar_cache
from .launched import LaunchedStep, launch_picks
from .release import BoundPolicies, decode_counts
from .runner import ModelRunner
from .sampling import batchable, float_scores, next_tokens

__all__ = ["BlockTables", "BoundPolicies", "LaunchedStep", "MaskBuffers", "ModelRunner", "StructuredOutputError",
           "apply_masks", "batchable", "decode_counts", "float_scores", "grammar_cache", "launch_picks",
           "next_tokens"]
