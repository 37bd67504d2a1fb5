"""Testbed v1 (the earlier character-level testbed): four seeded task families mirroring the paper's
fields, each with splits and an exact evaluator.

    math     word problems: a scratchpad, then "Answer: <number>"            (like GSM8K)
    sql      text-to-SQL over a small schema, scored by executing the query (like Spider)
    mcq      four-option multiple choice, answered with one letter          (like MedQA-4)
    explain  a few sentences of explanation, then "Answer: <letter>"        (like ScienceQA)

Examples are generated from a seed per split, so every machine builds the same data.
"""

from __future__ import annotations

import random
import re
from ..sql import DEPARTMENTS, build_database, same_result
from ..task import Task

SPLITS = {"train": (0, 2000), "validation": (1, 200), "test": (2, 300)}  # split -> (seed, size)
LETTERS = "ABCD"
NAMES = ["Tom", "Ann", "Raj", "Lea", "Kai", "Zoe", "Max", "Uma"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells"]


def _final_answer(text: str) -> str | None:
    match = re.search(r"Answer:\s*([^\s.]+)", text)
    return match.group(1) if match else None


def _math(rng: random.Random) -> dict:
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    # Small operands: a 1.6M-parameter character model can learn this arithmetic in minutes.
    a, b, c = rng.randrange(2, 10), rng.randrange(2, 10), rng.randrange(1, 6)
    total = a + b
    kind = rng.randrange(3)
    if kind == 0:
        q = f"{who} has {a} {item} and gets {b} more. Then {who} gives away {c}. How many {item} are left?"
        steps, ans = f"{a} + {b} = {total}. {total} - {c} = {total - c}.", total - c
    elif kind == 1:
        q = f"{who} buys {c} boxes with {a} {item} in each box and already had {b}. How many {item} now?"
        steps, ans = f"{c} * {a} = {c * a}. {c * a} + {b} = {c * a + b}.", c * a + b
    else:
        q = f"{who} shares {a * c} {item} equally among {c} friends and keeps none. How many does each friend get?"
        steps, ans = f"{a * c} / {c} = {a}.", a
    return {"prompt": f"Question: {q}\nSolution:", "reference": f" {steps} Answer: {ans}", "answer": str(ans)}


SQL_TEMPLATES = [
    ("How many employees work in {dept}?", "SELECT COUNT(*) FROM employees WHERE dept = '{dept}'"),
    ("What is the highest salary in {dept}?", "SELECT MAX(salary) FROM employees WHERE dept = '{dept}'"),
    ("List the names of employees in {dept} older than {age}.",
     "SELECT name FROM employees WHERE dept = '{dept}' AND age > {age}"),
    ("How many employees work in departments located in {city}?",
     "SELECT COUNT(*) FROM employees JOIN departments ON employees.dept = departments.name WHERE city = '{city}'"),
    ("What is the average age of employees earning more than {salary}?",
     "SELECT AVG(age) FROM employees WHERE salary > {salary}"),
]


def _sql(rng: random.Random) -> dict:
    question, query = rng.choice(SQL_TEMPLATES)
    dept, city = rng.choice(DEPARTMENTS)
    values = dict(dept=dept, city=city, age=rng.randrange(25, 55), salary=rng.randrange(40, 140) * 1000)
    return {"prompt": f"Question: {question.format(**values)}\nSQL:", "reference": f" {query.format(**values)}"}


FACTS = [  # (question, right answer, distractors)
    ("Which organ pumps blood through the body?", "heart", ["lung", "liver", "kidney"]),
    ("Which organ exchanges oxygen with the air?", "lung", ["heart", "stomach", "skin"]),
    ("Which vitamin does sunlight help the skin make?", "vitamin D", ["vitamin C", "vitamin A", "vitamin K"]),
    ("Which cells carry oxygen in the blood?", "red cells", ["white cells", "platelets", "neurons"]),
    ("Which organ filters the blood to make urine?", "kidney", ["liver", "heart", "spleen"]),
    ("Which gland makes insulin?", "pancreas", ["thyroid", "adrenal", "pituitary"]),
    ("What state of matter has a fixed shape?", "solid", ["liquid", "gas", "plasma"]),
    ("What force pulls objects toward the Earth?", "gravity", ["friction", "magnetism", "tension"]),
    ("What do plants take in to make food?", "carbon dioxide", ["oxygen", "nitrogen", "helium"]),
    ("What is the boiling point of water in Celsius?", "100", ["50", "0", "212"]),
    ("Which planet is closest to the Sun?", "Mercury", ["Venus", "Mars", "Earth"]),
    ("What kind of energy does a moving car have?", "kinetic", ["potential", "chemical", "nuclear"]),
]
WHY = {
    "heart": "The heart is a muscle that contracts to push blood.",
    "lung": "The lungs hold air sacs where oxygen enters the blood.",
    "vitamin D": "Skin makes vitamin D when sunlight reaches it.",
    "red cells": "Red cells contain hemoglobin, which binds oxygen.",
    "kidney": "The kidneys remove waste from blood as urine.",
    "pancreas": "The pancreas releases insulin to control sugar.",
    "solid": "Particles in a solid are held in fixed places.",
    "gravity": "Gravity attracts masses toward each other.",
    "carbon dioxide": "Photosynthesis turns carbon dioxide and water into sugar.",
    "100": "At sea level water boils at one hundred degrees.",
    "Mercury": "Mercury has the smallest orbit of all planets.",
    "kinetic": "Kinetic energy is the energy of motion.",
}


def _choices(rng: random.Random) -> tuple[str, str, str]:
    question, right, wrong = rng.choice(FACTS)
    options = [right] + rng.sample(wrong, 3)
    rng.shuffle(options)
    letter = LETTERS[options.index(right)]
    listing = " ".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(options))
    return f"Question: {question} {listing}", letter, right


def _mcq(rng: random.Random) -> dict:
    stem, letter, _ = _choices(rng)
    return {"prompt": f"{stem}\nAnswer:", "reference": f" {letter}", "answer": letter}


def _explain(rng: random.Random) -> dict:
    stem, letter, right = _choices(rng)
    return {"prompt": f"{stem}\nExplain, then answer.\n", "reference": f"{WHY[right]} So the answer is {right}. "
            f"Answer: {letter}", "answer": letter}


_DB = None


def _score_sql(prediction: str, example: dict) -> bool:
    global _DB
    if _DB is None:
        _DB = build_database()
    query = prediction.strip().split("\n")[0]
    return same_result(_DB, query, example["reference"].strip())


def _score_letter_first(prediction: str, example: dict) -> bool:
    match = re.match(r"\s*\(?([ABCD])\b", prediction)
    return bool(match) and match.group(1) == example["answer"]


def _score_final(prediction: str, example: dict) -> bool:
    return _final_answer(prediction) == example["answer"]


def make_tasks() -> dict[str, Task]:
    """The four testbed tasks, by adapter name."""
    return {
        "math": Task("math", _math, _score_final, 48),
        "sql": Task("sql", _sql, _score_sql, 64),
        "mcq": Task("mcq", _mcq, _score_letter_first, 4),
        "explain": Task("explain", _explain, _score_final, 128),
    }
