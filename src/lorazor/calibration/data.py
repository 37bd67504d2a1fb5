"""Calibration data from a file or a Hugging Face dataset, one example a row, read with `datasets`.

A row holds `adapter` (the adapter it calibrates), `prompt` (text) or `messages` (a chat, rendered
with the tokenizer's chat template), and `reference` (what the scorer compares the answer with);
other fields stay in the row and reach the scorer. `columns` maps these names to other column
names. With one adapter, rows may leave `adapter` out. `load_validation` groups the rows into one
`ValidationSet` per adapter; every problem is refused with where it is (file and line, or row).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .scorers import Scorer
from .lengths import ValidationSet

FIELDS = ("adapter", "prompt", "messages", "reference", "max_new_tokens")
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """Calibration data that cannot be used: the message says which file, line or row, and why."""


def parse_columns(spec: str | None) -> dict[str, str]:
    """`prompt=question,reference=answer` -> {"prompt": "question", "reference": "answer"}."""
    mapping = {}
    for part in filter(None, (spec or "").split(",")):
        ours, sep, theirs = part.partition("=")
        if not sep or ours not in FIELDS or not theirs:
            raise DataError(f"--columns {spec!r}: give FIELD=COLUMN pairs, FIELD one of {', '.join(FIELDS)}")
        mapping[ours] = theirs
    return mapping


def _check_jsonl(path: Path) -> None:
    """Empty or malformed lines are refused with their line number (datasets would not say where)."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                raise DataError(f"{path}:{number}: empty line (one JSON object per line)")
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}:{number}: a row must be a JSON object, got {type(value).__name__}")


def read_rows(source: str, split: str | None = None, default_split: str = "validation") -> tuple[list[dict], callable]:
    """(rows, where(i) -> "file:line" or "row i") of a local file, or of a Hub dataset's `split`
    (None: `default_split`). A split given with a local file is refused: a file has no splits."""
    import datasets

    path = Path(source)
    if path.exists():
        if split is not None:
            raise DataError(f"{path} is a file, which has no splits: leave out the split {split!r} (it applies to a "
                            "Hugging Face dataset id)")
        kind = FORMATS.get(path.suffix.lower())
        if kind is None:
            raise DataError(f"{path}: unknown data format {path.suffix!r}; use {', '.join(FORMATS)}")
        if path.suffix.lower() == ".jsonl":
            _check_jsonl(path)
        try:
            table = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as err:
            raise DataError(f"{path}: could not read it as {kind} ({type(err).__name__}: {err})") from None
        offset = {".jsonl": 1, ".csv": 2}.get(path.suffix.lower())
        where = (lambda i: f"{path}:{i + offset}") if offset else (lambda i: f"{path} row {i}")
    else:
        split = split or default_split
        try:
            table = datasets.load_dataset(source, split=split)
        except Exception as err:
            raise DataError(f"{source!r} is neither a file nor a loadable dataset split {split!r} "
                            f"({type(err).__name__}: {err})") from None
        where = lambda i: f"{source} [{split}] row {i}"  # noqa: E731
    return [dict(row) for row in table], where


def _prompt_of(row: dict, tokenizer, here: str) -> str:
    prompt, messages = row.get("prompt"), row.get("messages")
    if isinstance(prompt, str) and prompt:
        return prompt
    if messages:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in messages):
            raise DataError(f"{here}: messages must be a list of {{'role', 'content'}} objects")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{here}: a chat example, but the tokenizer has no chat template")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    raise DataError(f"{here}: needs a non-empty 'prompt' (text) or 'messages' (a chat)")


def load_validation(source: str, adapters: list[str], scorer: Scorer, metric_name: str, tokenizer,
                    max_new_tokens: int, split: str | None = None, columns: dict[str, str] | None = None,
                    generate_kwargs: dict | None = None, limit: int | None = None,
                    seed: int | None = None, default_split: str = "validation") -> dict[str, ValidationSet]:
    """One `ValidationSet` per adapter of `adapters` from the rows of `source` (see the module
    docstring). A row's `max_new_tokens` overrides `max_new_tokens` (the same within an adapter).
    `seed`: shuffle each adapter's rows with it; `limit`: then keep the first `limit` of them."""
    rows, where = read_rows(source, split, default_split)
    if not rows:
        raise DataError(f"{source}: no examples")
    rename = {theirs: ours for ours, theirs in (columns or {}).items()}
    by_adapter: dict[str, list[tuple[dict, str]]] = {name: [] for name in adapters}
    lengths: dict[str, int] = {}
    for i, raw in enumerate(rows):
        row = {rename.get(k, k): v for k, v in raw.items()}
        here = where(i)
        adapter = row.get("adapter")
        if adapter is None:
            if len(adapters) != 1:
                raise DataError(f"{here}: no 'adapter' field, and {len(adapters)} adapters are calibrated")
            adapter = row["adapter"] = adapters[0]
        if adapter not in by_adapter:
            raise DataError(f"{here}: adapter {adapter!r} is not one of the adapters given ({', '.join(adapters)})")
        if row.get("reference") is None:
            raise DataError(f"{here}: needs a 'reference' (what the answer is scored against)")
        row["prompt"] = _prompt_of(row, tokenizer, here)
        n = int(row.get("max_new_tokens") or max_new_tokens)
        if lengths.setdefault(adapter, n) != n:
            raise DataError(
                f"{here}: max_new_tokens {n} differs from {lengths[adapter]} earlier for adapter {adapter!r}"
            )
        by_adapter[adapter].append((row, here))
    for items in by_adapter.values():
        if seed is not None:
            random.Random(seed).shuffle(items)
        if limit is not None:
            del items[limit:]
    empty = [name for name, items in by_adapter.items() if not items]
    if empty:
        raise DataError(f"{source}: no examples for adapters {empty}")
    return {name: ValidationSet([row["prompt"] for row, _ in items], _scored(scorer, metric_name, items, name),
                                dict(generate_kwargs or {}, max_new_tokens=lengths[name]))
            for name, items in by_adapter.items()}


def _scored(scorer: Scorer, metric_name: str, items: list[tuple[dict, str]], adapter: str):
    """`ValidationSet.score(text, i)` over these rows: a scorer that raises or returns something
    other than a bool or a number is refused, naming the example."""

    def score(text: str, i: int) -> float:
        row, here = items[i]
        try:
            value = scorer(text, row)
        except Exception as err:
            raise DataError(f"scorer {metric_name!r} raised on {here} (adapter {adapter!r}): "
                            f"{type(err).__name__}: {err}") from err
        if isinstance(value, bool) or isinstance(value, (int, float)):
            return float(value) >= 0.5
        raise DataError(f"scorer {metric_name!r} returned {type(value).__name__} on {here}: it must return a bool "
                        "or a number (>= 0.5 counts as correct)")

    return score
