"""Pretraining text for testbed v2's backbone: the tasks' knowledge and answer styles, none of
their formats.

The backbone should be able to *continue* an answer once an adapter has started it, so the corpus
holds the skills the tasks' answers need, in their surface forms, after other cues:
- word problems told as stories (some closing with their question) and solved in prose
  ("First ... Then ...") or in "Step k:" lines;
- SQL over the corpus's own schema (employees, departments), never the sql task's (staff, units);
- clinical signs and why they point to an organ, worked clinical quizzes (options inline, after a
  "Case quiz." cue) and letter quizzes on other topics (options inline or one per line), all ending
  in "The answer is X.";
- science rules, which things follow them, and four-option "Pick the one that is ..." explanations
  that end in "So the answer is (X).".
It never shows the tasks' prompts and cues ("Problem: ... Solution:", "Request:", "Vignette:",
"Which of these is ...? ... Explanation:"), the "####" marker or the task schema's names: those,
and how to open an answer after them, are what each task's adapter teaches.
"""

from __future__ import annotations

import random

from .knowledge import CORPUS_SCHEMA, ITEMS, NAMES, ORGANS, SCIENCE
from .tasks import LETTERS, sql_pair, story_events


def _story(rng: random.Random) -> str:
    who, item, start, events = story_events(rng)
    told = " ".join(e[0] for e in events)
    # Stories open and close as word problems do ("Tom has 5 pens. ... How many pens does Tom have
    # now?") or otherwise. A backbone that never saw the question overran the last event (wrote one
    # step more) in 15 of 40 math answers released after 4 steps: it had no cue that events ended.
    opening = f"{who} has {start} {item}." if rng.random() < 0.5 else f"{who} started the day with {start} {item}."
    if rng.random() < 0.5:
        told += f" How many {item} does {who} have now?"
    if rng.random() < 0.5:  # the tasks' scratchpad form, after a cue the math task never uses
        steps = " ".join(f"Step {i + 1}: {e[1]}." for i, e in enumerate(events))
        return f"{opening} {told} Working it out: {steps} In the end {events[-1][2]}.\n"
    words = ["First", "Then", "Next", "After that"]
    solution = " ".join(f"{words[min(i, 3)]}, {e[1]}." for i, e in enumerate(events))
    return f"{opening} {told} Let us count. {solution} In the end {who} has {events[-1][2]} {item}.\n"


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


# Categories for letter quizzes on topics the tasks never ask about: the skill of finding the letter
# of the option an explanation named, over thousands of option sets rather than a few memorizable ones.
CATEGORIES = {
    "color": ["red", "green", "blue", "yellow", "purple", "orange"],
    "fruit": ["an apple", "a banana", "a cherry", "a grape", "a lemon", "a mango"],
    "tool": ["a hammer", "a saw", "a wrench", "a drill", "a chisel", "a shovel"],
    "vehicle": ["a car", "a bus", "a train", "a bicycle", "a truck", "a boat"],
    "musical instrument": ["a piano", "a violin", "a flute", "a drum", "a guitar", "a trumpet"],
    "country": ["France", "Japan", "Brazil", "Kenya", "Canada", "India"],
    "bird": ["an eagle", "a sparrow", "a robin", "an owl", "a parrot", "a crow"],
    "vegetable": ["a carrot", "an onion", "a potato", "a leek", "a pepper", "a cabbage"],
    "sport": ["tennis", "soccer", "golf", "rugby", "hockey", "cricket"],
    "month": ["January", "March", "May", "July", "October", "December"],
}


def _listing(rng: random.Random, options: list[str]) -> str:
    """Options one per line ("A. x", as the medqa task lists them) or inline ("A) x")."""
    if rng.random() < 0.5:
        return "\n" + "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options)) + "\n"
    return " " + " ".join(f"{LETTERS[i]}) {o}" for i, o in enumerate(options)) + ". "


def _quiz(rng: random.Random) -> str:
    category, other = rng.sample(sorted(CATEGORIES), 2)
    right = rng.choice(CATEGORIES[category])
    wrong = rng.sample([x for c in CATEGORIES if c != category for x in CATEGORIES[c]], 3)
    options = [right] + wrong
    rng.shuffle(options)
    letter = LETTERS[options.index(right)]
    return (f"Quiz. Name the {category}.{_listing(rng, options)}{right[0].upper() + right[1:]} is a {category}. "
            f"The others are not. The answer is {letter}.\n")


def _clinical_quiz(rng: random.Random) -> str:
    """Worked clinical multiple choice in the medqa answer style, after a question form the task never
    uses, so a backbone can finish a medqa answer an adapter has started. Options come inline or one
    per line: with only inline ones, a medqa adapter trained on the first H200 backbone named the
    right organ every time but its letter half the time."""
    organ = rng.choice(sorted(ORGANS))
    signs, why = ORGANS[organ]
    a, b = rng.sample(signs, 2)
    options = [organ] + rng.sample([o for o in ORGANS if o != organ], 3)
    rng.shuffle(options)
    return (f"Case quiz. Signs: {a}, {b}. Organ?{_listing(rng, options)}{a.capitalize()} and {b} point to the "
            f"{organ}. {why} The other options do not explain {a}. The answer is {LETTERS[options.index(organ)]}.\n")


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


SOURCES = (_story, _story, _arithmetic, _sql, _clinical, _clinical_quiz, _quiz, _science)


def pretraining_documents(num_chars: int, seed: int = 0) -> list[str]:
    """About `num_chars` characters of the mixed corpus as documents, deterministic for a seed."""
    rng = random.Random(f"v2-corpus-{seed}")
    docs, size = [], 0
    while size < num_chars:
        docs.append(rng.choice(SOURCES)(rng))
        size += len(docs[-1])
    return docs


def pretraining_text(num_chars: int, seed: int = 0) -> str:
    """The documents of `pretraining_documents`, joined."""
    return "".join(pretraining_documents(num_chars, seed))
