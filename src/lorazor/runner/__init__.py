"""The model runner shared by `generate()` and the engine: forwards, LM head, LoRA step context, KV
caches, CUDA graphs and StepTrim decisions (see `runner.py`), and what the engine takes from it for
a step: `PagedSteps` (`paged_steps.py`), the device side of every engine step (the paged KV pool,
the block tables, the step graphs, the StepTrim policies bound to the adapter slots, the grammar
bitmasks), fed host lists (`StepInputs`, `Picks`) and returning a `LaunchedStep` read back once
(`launched.py`); sampling on the host (`sampling.py`) and grammar caches (`grammar.py`). The
engine imports these names from here, never from the modules."""

from .grammar import StructuredOutputError, grammar_cache
from .launched import LaunchedStep, Picks
from .paged_steps import PagedSteps, StepInputs
from .release import decode_counts
from .runner import ModelRunner
from .sampling import batchable, float_scores, next_tokens

__all__ = ["LaunchedStep", "ModelRunner", "PagedSteps", "Picks", "StepInputs", "StructuredOutputError",
           "batchable", "decode_counts", "float_scores", "grammar_cache", "next_tokens"]
