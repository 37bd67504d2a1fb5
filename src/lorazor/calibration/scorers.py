"""Scorers for calibration data: how an answer is judged against its example's reference.

A scorer is `score(answer: str, example: dict) -> bool | float` (the example is the data row, its
`reference` field included); a value of at least 0.5 counts as correct. Built in (`--metric`):

    exact_match          the answer, stripped, equals the reference, stripped
    prefix_match         the answer, stripped, starts with the reference, stripped
    contains             the reference, stripped, occurs anywhere in the answer
    regex:PATTERN        PATTERN's first match in the answer's whole text (its first group when it
                         has one) equals the reference, stripped
    choice               the first standalone letter A-D in the answer equals the reference's
    python:MOD:FUNC      your own function `FUNC(answer, example)` from module MOD (importable)
    evaluate:NAME        the `evaluate` library's metric NAME on (answer, reference): its first
                         numeric result. `evaluate` fetches a metric's code from the Hugging Face
                         Hub the first time: it needs the network once, or a warm cache.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

Scorer = Callable[[str, dict], "bool | float"]
BUILT_IN = ("exact_match", "prefix_match", "contains", "regex:PATTERN", "choice", "python:MODULE:FUNCTION",
            "evaluate:NAME")
_LETTER = re.compile(r"\b([A-D])\b")


def _reference(example: dict) -> str:
    return str(example.get("reference", "")).strip()


def exact_match(answer: str, example: dict) -> bool:
    return answer.strip() == _reference(example)


def prefix_match(answer: str, example: dict) -> bool:
    return answer.strip().startswith(_reference(example))


def contains(answer: str, example: dict) -> bool:
    return _reference(example) in answer


def choice(answer: str, example: dict) -> bool:
    got, want = _LETTER.search(answer), _LETTER.search(_reference(example)) or _LETTER.search(
        _reference(example).upper())
    return got is not None and want is not None and got.group(1) == want.group(1)


def regex_scorer(pattern: str) -> Scorer:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"--metric regex:{pattern}: not a valid regular expression ({err})") from None

    def score(answer: str, example: dict) -> bool:
        match = compiled.search(answer)
        if match is None:
            return False
        return (match.group(1) if compiled.groups else match.group(0)).strip() == _reference(example)

    return score


def python_scorer(spec: str) -> Scorer:
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise ValueError(f"--metric python:{spec}: give python:MODULE:FUNCTION, e.g. python:my_scorers:score")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--metric python:{spec}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--metric python:{spec}: module {module_name!r} has no function {name!r}")
    return fn


def evaluate_scorer(name: str) -> Scorer:
    try:
        import evaluate
    except ImportError:
        raise ValueError(f"--metric evaluate:{name} needs the `evaluate` package: pip install evaluate") from None
    try:
        metric = evaluate.load(name)
    except Exception as err:  # network, cache and unknown names all end here
        raise ValueError(f"--metric evaluate:{name}: could not load the metric ({type(err).__name__}: {err}). "
                         "evaluate fetches a metric's code from the Hugging Face Hub on first use: run once "
                         "online, or use a built-in metric offline") from None

    def score(answer: str, example: dict) -> float:
        result = metric.compute(predictions=[answer.strip()], references=[_reference(example)])
        value = next((v for v in result.values() if isinstance(v, (int, float))), None)
        if value is None:
            raise ValueError(f"evaluate metric {name!r} returned no number: {result}")
        return float(value)

    return score


def resolve_metric(spec: str) -> Scorer:
    """The scorer a `--metric` value names (see the module docstring); ValueError otherwise."""
    simple = {"exact_match": exact_match, "prefix_match": prefix_match, "contains": contains, "choice": choice}
    if spec in simple:
        return simple[spec]
    kind, sep, rest = spec.partition(":")
    if sep and rest:
        if kind == "regex":
            return regex_scorer(rest)
        if kind == "python":
            return python_scorer(rest)
        if kind == "evaluate":
            return evaluate_scorer(rest)
    raise ValueError(f"unknown --metric {spec!r}; use one of {', '.join(BUILT_IN)}")
