"""`Task`: a testbed task family, its seeded splits and its exact evaluator (every testbed version's)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

# split -> (seed, size): testbed v1's splits; v2's tasks give their own.
DEFAULT_SPLITS = {"train": (0, 2000), "validation": (1, 200), "test": (2, 300)}


@dataclass
class Task:
    """A task family: `split(name)` examples with `prompt` and `reference`, and an exact `score`."""

    name: str
    make: Callable[[random.Random], dict]
    scorer: Callable[[str, dict], bool]
    max_new_tokens: int
    splits: dict = field(default_factory=lambda: dict(DEFAULT_SPLITS))  # split -> (seed, size)
    seed_tag: str = ""  # prefixes the split seeds (testbed v2: "v2-")
    _cache: dict = field(default_factory=dict, repr=False)

    def split(self, name: str) -> list[dict]:
        """The deterministic examples of split `name` ("train", "validation" or "test")."""
        if name not in self.splits:
            raise KeyError(f"unknown split {name!r}; splits: {sorted(self.splits)}")
        if name not in self._cache:
            seed, size = self.splits[name]
            rng = random.Random(f"{self.seed_tag}{self.name}-{seed}")
            make = self.maker(name)
            self._cache[name] = [make(rng) for _ in range(size)]
        return self._cache[name]

    def maker(self, split: str) -> Callable[[random.Random], dict]:
        """What draws one example of `split` (the same for every split unless a task says otherwise)."""
        return self.make

    def score(self, prediction: str, example: dict) -> bool:
        """Whether a model's continuation of `example["prompt"]` is correct."""
        return self.scorer(prediction, example)
