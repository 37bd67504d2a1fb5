"""Pretraining text for the testbed backbone: general prose in the tasks' domains, none of their formats.

The backbone learns the vocabulary, facts, arithmetic sentences and SQL it will meet, so it can
continue an answer, but never sees "Question: ... Answer: X", so each task's conventions are what
its adapter adds.
"""

from __future__ import annotations

import random

from ..sql import DEPARTMENTS, FIRST_NAMES
from .tasks import FACTS, ITEMS, NAMES, WHY


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(2, 60), rng.randrange(2, 30)
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice([
        f"{a} + {b} = {a + b}. ",
        f"{a + b} - {b} = {a}. ",
        f"{a % 10 + 1} * {b} = {(a % 10 + 1) * b}. ",
        f"{who} had {a} {item} and found {b} more, so {who} had {a + b} {item}. ",
        f"When {a + b} {item} are split and {b} go away, {a} {item} stay. ",
    ])


def _facts(rng: random.Random) -> str:
    question, right, _ = rng.choice(FACTS)
    return rng.choice([f"{WHY[right]} ", f"{question} People say the {right}. ", f"The {right} matters. "])


def _sql(rng: random.Random) -> str:
    dept, city = rng.choice(DEPARTMENTS)
    name = rng.choice(FIRST_NAMES)
    return rng.choice([
        f"The {dept} department is in {city}. ",
        f"{name} works in {dept}. ",
        f"SELECT name FROM employees WHERE dept = '{dept}' ",
        "SELECT COUNT(*) FROM employees ",
        "A table of employees has a name, a dept, a salary and an age. ",
    ])


def pretraining_text(num_chars: int, seed: int = 0) -> str:
    """About `num_chars` characters of mixed-domain prose, deterministic for a seed."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_chars:
        piece = rng.choice((_arithmetic, _facts, _sql))(rng)
        if rng.random() < 0.1:
            piece += "\n"
        parts.append(piece)
        size += len(piece)
    return "".join(parts)
