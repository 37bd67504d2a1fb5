"""Testbed v2's four tasks: answers of tens of subword tokens, each in a format the backbone's
corpus never shows (`corpus.py` writes the same knowledge in other formats).

    math     word problems of 3-5 events, a "Step k:" scratchpad, then "#### <number>"   (GSM8K)
    sql      questions over the task's own schema (staff, units), scored by execution    (Spider)
    medqa    a clinical vignette with four options, one reasoning sentence, the letter  (MedQA-4)
    science  which of four things has a property: an explanation, then "(<letter>)"     (ScienceQA)

Evaluators are exact and lenient only where the real benchmarks are. Each reads the answer's first
line (answers are one line; harnesses stop at a newline too): math takes the number after "####",
else the last number (as GSM8K scripts do); the letter tasks take the last "answer is X".
Splits are generated from a seed per task and split, so every machine builds the same data; their
sizes follow the paper's Table 2 in spirit (validation a few hundred, test several hundred).
"""

from __future__ import annotations

import random
import re

from .sql import TaskDatabase, same_result
from .task import Task
from .knowledge import ITEMS, NAMES, ORGANS, SCIENCE, TASK_SCHEMA, UNITS, ddl

SPLITS = {"train": (10, 4000), "validation": (11, 300), "test": (12, 600)}
LETTERS = "ABCD"


# ---- math ---------------------------------------------------------------------------------------
def story_events(rng: random.Random) -> tuple[str, str, int, list[tuple[str, str, int]]]:
    """(who, item, start, events): each event is (sentence, worked arithmetic, value after it)."""
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = start = rng.randrange(5, 40)
    events = []
    for _ in range(rng.randrange(3, 6)):
        kind = rng.randrange(4)
        if kind == 0:
            n, m = rng.randrange(2, 6), rng.randrange(2, 10)
            new = value + n * m
            events.append((f"{who} buys {n} packs of {m} {item}.", f"{n} * {m} = {n * m}, {value} + {n * m} = {new}",
                           new))
        elif kind == 1 and value > 3:
            g = rng.randrange(1, value)
            events.append((f"{who} gives {g} {item} to a friend.", f"{value} - {g} = {value - g}", value - g))
        elif kind == 2 and value % 2 == 0 and value >= 4:
            events.append((f"{who} loses half of the {item}.", f"{value} / 2 = {value // 2}", value // 2))
        else:
            f = rng.randrange(2, 20)
            events.append((f"{who} finds {f} more {item}.", f"{value} + {f} = {value + f}", value + f))
        value = events[-1][2]
    return who, item, start, events


def _math(rng: random.Random) -> dict:
    who, item, start, events = story_events(rng)
    question = f"{who} has {start} {item}. " + " ".join(e[0] for e in events) + f" How many {item} does {who} have now?"
    steps = " ".join(f"Step {i + 1}: {e[1]}." for i, e in enumerate(events))
    answer = events[-1][2]
    return {"prompt": f"Problem: {question}\nSolution:", "reference": f" {steps} #### {answer}", "answer": str(answer)}


def first_line(prediction: str) -> str:
    """Every v2 answer is one line: evaluators read up to the first newline, as evaluation harnesses
    stop a base model's continuation at a stop sequence (a backbone that carries on after a release
    may go on to write another document)."""
    return prediction.split("\n", 1)[0]


def _score_math(prediction: str, example: dict) -> bool:
    prediction = first_line(prediction)
    marked = re.search(r"####\s*(-?\d+)", prediction)
    numbers = re.findall(r"-?\d+", prediction)
    got = marked.group(1) if marked else (numbers[-1] if numbers else None)
    return got == example["answer"]


# ---- sql ----------------------------------------------------------------------------------------
SQL_QUESTIONS = [  # (question, query over a schema mapping `s`)
    ("How many people work in {unit}?", "SELECT COUNT(*) FROM {people} WHERE {dept} = '{unit}'"),
    ("What is the highest pay in {unit}?", "SELECT MAX({pay}) FROM {people} WHERE {dept} = '{unit}'"),
    ("List the names of people in {unit} older than {years}.",
     "SELECT {name} FROM {people} WHERE {dept} = '{unit}' AND {age} > {years}"),
    ("How many people work in groups located in {town}?",
     "SELECT COUNT(*) FROM {people} JOIN {group} ON {people}.{dept} = {group}.{group_name} WHERE {place} = '{town}'"),
    ("What is the average age of people paid more than {wage}?",
     "SELECT AVG({age}) FROM {people} WHERE {pay} > {wage}"),
    ("Which town is the {unit} group in?", "SELECT {place} FROM {group} WHERE {group_name} = '{unit}'"),
    ("List the names of people aged {years} or younger, youngest first.",
     "SELECT {name} FROM {people} WHERE {age} <= {years} ORDER BY {age}, {name}"),
    ("What is the total pay of {unit}?", "SELECT SUM({pay}) FROM {people} WHERE {dept} = '{unit}'"),
]


def sql_pair(rng: random.Random, schema: dict) -> tuple[str, str]:
    """(question, query over `schema`) for random values."""
    question, query = rng.choice(SQL_QUESTIONS)
    unit, town = rng.choice(UNITS)
    values = dict(unit=unit, town=rng.choice(UNITS)[1] if rng.random() < 0.3 else town, years=rng.randrange(25, 60),
                  wage=rng.randrange(40, 140) * 1000)
    return question.format(**values), query.format(**schema, **values)


def _sql(rng: random.Random) -> dict:
    question, query = sql_pair(rng, TASK_SCHEMA)
    return {"prompt": f"Request: {question}\nQuery:", "reference": f" {query}"}


def _fill_task_db(rng: random.Random) -> dict[str, list[tuple]]:
    first = ["ana", "ben", "chen", "dara", "eli", "fay", "gus", "hana", "ivo", "jun", "kai", "lea"]
    people = [(i, first[i % len(first)] + str(i // len(first)), rng.choice(UNITS)[0], rng.randrange(30, 150) * 1000,
               rng.randrange(21, 65)) for i in range(80)]
    return {TASK_SCHEMA["group"]: UNITS, TASK_SCHEMA["people"]: people}


_DB: TaskDatabase | None = None


def task_database() -> TaskDatabase:
    """The sql task's database (TASK_SCHEMA), built once."""
    global _DB
    if _DB is None:
        _DB = TaskDatabase(0, ddl(TASK_SCHEMA), frozenset({TASK_SCHEMA["people"], TASK_SCHEMA["group"]}),
                           _fill_task_db)
    return _DB


def _score_sql(prediction: str, example: dict) -> bool:
    return same_result(task_database(), first_line(prediction.strip()), example["reference"].strip())


# ---- letter tasks -------------------------------------------------------------------------------
def _options(rng: random.Random, right: str, wrong: list[str]) -> tuple[list[str], str]:
    options = [right] + rng.sample(wrong, 3)
    rng.shuffle(options)
    return options, LETTERS[options.index(right)]


def _medqa(rng: random.Random) -> dict:
    organ = rng.choice(sorted(ORGANS))
    signs, why = ORGANS[organ]
    a, b = rng.sample(signs, 2)
    options, letter = _options(rng, organ, [o for o in ORGANS if o != organ])
    person = f"{rng.randrange(18, 85)}-year-old {rng.choice(['man', 'woman'])}"
    listing = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    return {"prompt": f"Vignette: A {person} presents with {a} and {b}. Which organ is most likely affected?\n"
                      f"{listing}\nResponse:",
            "reference": f" {a.capitalize()} and {b} point to the {organ}. {why} The other options do not explain "
                         f"{a}. The answer is {letter}.",
            "answer": letter}


def _science(rng: random.Random) -> dict:
    prop = rng.choice(sorted(SCIENCE))
    phrase, rule, membership, members, others = SCIENCE[prop]
    right = rng.choice(members)
    options, letter = _options(rng, right, others)
    listing = " ".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(options))
    return {"prompt": f"Which of these is {phrase}? {listing}\nExplanation:",
            "reference": f" {rule} {right.capitalize()} {membership}. None of the others does. "
                         f"So the answer is ({letter}).",
            "answer": letter}


def _score_letter(prediction: str, example: dict) -> bool:
    found = re.findall(r"answer is \(?([ABCD])\b", first_line(prediction))
    return bool(found) and found[-1] == example["answer"]


def make_tasks() -> dict[str, Task]:
    """The four v2 tasks, by adapter name (max_new_tokens in subword tokens)."""
    return {name: Task(name, make, score, max_new, splits=SPLITS, seed_tag="v2-") for name, make, score, max_new in (
        ("math", _math, _score_math, 160), ("sql", _sql, _score_sql, 96), ("medqa", _medqa, _score_letter, 96),
        ("science", _science, _score_letter, 96))}
