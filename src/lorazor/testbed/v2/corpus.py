"""Pretraining text for testbed v2's backbone: the tasks' knowledge and answer styles, none of
their formats.

The backbone should be able to *continue* an answer once an adapter has started it, so the corpus
holds the skills the tasks' answers need, in their surface forms, after other cues:
- word problems told as stories and solved in prose ("First ... Then ...") or in "Step k:" lines;
- SQL over the corpus's own schema (employees, departments), never the sql task's (staff, units);
- clinical signs and why they point to an organ, and letter quizzes on other topics (options inline
  or one per line) that end in "The answer is X.";
- science rules, which things follow them, and four-option "Pick the one that is ..." explanations
  that end in "So the answer is (X).".
It never shows the tasks' prompts and cues ("Problem: ... Solution:", "Request:", "Vignette:",
"Which of these is ...? ... Explanation:"), the "####" marker or the task schema's names: those,
and how to open an answer after them, are what each task's adapter teaches.
"""

from __future__ import annotations

import random

from ..tasks import LETTERS
from .knowledge import CORPUS_SCHEMA, ITEMS, NAMES, ORGANS, SCIENCE
from .tasks import sql_pair, story_events


def _story(rng: random.Random) -> str:
    who, item, start, events = story_events(rng)
    told = " ".join(e[0] for e in events)
    if rng.random() < 0.5:  # the tasks' scratchpad form, after a cue the math task never uses
        steps = " ".join(f"Step {i + 1}: {e[1]}." for i, e in enumerate(events))
        return f"{who} started the day with {start} {item}. {told} Working it out: {steps} In the end {events[-1][2]}.\n"
    words = ["First", "Then", "Next", "After that"]
    solution = " ".join(f"{words[min(i, 3)]}, {e[1]}." for i, e in enumerate(events))
    return (f"{who} started the day with {start} {item}. {told} Let us count. {solution} "
            f"In the end {who} has {events[-1][2]} {item}.\n")


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(2, 200), rng.randrange(2, 60)
    n, m = rng.randrange(2, 10), rng.randrange(2, 12)
    return rng.choice([f"{a} + {b} = {a + b}. ", f"{a + b} - {b} = {a}. ", f"{n} * {m} = {n * m}. ",
                       f"{2 * a} / 2 = {a}. ", f"{rng.choice(NAMES)} counts {a} {rng.choice(ITEMS)}. "])


def _sql(rng: random.Random) -> str:
    question, query = sql_pair(rng, CORPUS_SCHEMA)
    s = CORPUS_SCHEMA
    return rng.choice([
        f"To answer \"{question}\" we can run {query} on the company database.\n",
        f"The query {query} answers the question: {question}\n",
        f"The table {s['people']} has columns {s['name']}, {s['dept']}, {s['pay']} and {s['age']}; the table "
        f"{s['group']} has {s['group_name']} and {s['place']}.\n",
    ])


def _clinical(rng: random.Random) -> str:
    organ = rng.choice(sorted(ORGANS))
    signs, why = ORGANS[organ]
    a, b = rng.sample(signs, 2)
    return rng.choice([f"{a.capitalize()} and {b} point to the {organ}. {why}\n",
                       f"Doctors link {a} with disease of the {organ}. {why}\n",
                       f"When a patient has {a}, check the {organ}. "])


QUIZZES = [  # topics the tasks never ask about: the letter-picking skill, on other knowledge
    ("Which city is the capital of France?", "Paris", ["Lyon", "Nice", "Lille"], "Paris is the seat of the French government."),
    ("Which animal is the largest?", "the blue whale", ["the horse", "the lion", "the eagle"], "A blue whale can weigh over 100 tonnes."),
    ("Which color do you get by mixing blue and yellow?", "green", ["red", "purple", "orange"], "Blue and yellow paint make green."),
    ("How many days are in a week?", "seven", ["five", "six", "eight"], "A week has seven days."),
    ("Which instrument has 88 keys?", "the piano", ["the violin", "the flute", "the drum"], "A piano keyboard has 88 keys."),
    ("Which season follows winter?", "spring", ["summer", "autumn", "fall"], "Spring comes after winter."),
]


def _quiz(rng: random.Random) -> str:
    question, right, wrong, why = rng.choice(QUIZZES)
    options = [right] + rng.sample(wrong, 3)
    rng.shuffle(options)
    letter = LETTERS[options.index(right)]
    if rng.random() < 0.5:  # options one per line, as the medqa task lists them
        listing = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
        return f"Quiz. {question}\n{listing}\n{why} The answer is {letter}.\n"
    listing = " ".join(f"{LETTERS[i]}) {o}" for i, o in enumerate(options))
    return f"Quiz. {question} {listing}. {why} The answer is {letter}.\n"


def _science(rng: random.Random) -> str:
    prop = rng.choice(sorted(SCIENCE))
    phrase, rule, membership, members, others = SCIENCE[prop]
    thing = rng.choice(members)
    if rng.random() < 0.5:  # four options and the tasks' closing, after a question form the task never uses
        choices = [thing] + rng.sample(others, 3)
        rng.shuffle(choices)
        listing = " ".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(choices))
        return (f"Pick the one that is {phrase}: {listing}. {rule} {thing.capitalize()} {membership}. None of the "
                f"others does. So the answer is ({LETTERS[choices.index(thing)]}).\n")
    other = rng.choice(others)
    return f"{rule} {thing.capitalize()} {membership}, so it is {phrase}. {other.capitalize()} is not.\n"


SOURCES = (_story, _story, _arithmetic, _sql, _clinical, _quiz, _science)


def pretraining_text(num_chars: int, seed: int = 0) -> str:
    """About `num_chars` characters of the mixed corpus, deterministic for a seed."""
    rng = random.Random(f"v2-corpus-{seed}")
    parts, size = [], 0
    while size < num_chars:
        piece = rng.choice(SOURCES)(rng)
        parts.append(piece)
        size += len(piece)
    return "".join(parts)
