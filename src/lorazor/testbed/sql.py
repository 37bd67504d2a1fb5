"""A small SQLite schema and a safe executor: read-only, time-limited, for scoring text-to-SQL."""

from __future__ import annotations

import random
import sqlite3
import time

SCHEMA = """
CREATE TABLE departments (name TEXT PRIMARY KEY, city TEXT NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept TEXT NOT NULL REFERENCES departments(name),
                        salary INTEGER NOT NULL, age INTEGER NOT NULL);
"""
DEPARTMENTS = [("sales", "paris"), ("research", "oslo"), ("support", "lima"), ("finance", "paris"), ("legal", "kyoto")]
FIRST_NAMES = ["ana", "ben", "chen", "dara", "eli", "fay", "gus", "hana", "ivo", "jun", "kai", "lea", "max", "nia",
               "omar", "pia", "raj", "sol", "tom", "uma", "vik", "wen", "yara", "zoe"]
# Abort a query after this long: a scorer must never hang on a model's runaway SQL.
TIME_LIMIT_S = 0.5


def build_database(seed: int = 0) -> sqlite3.Connection:
    """The task's database (deterministic for a seed), opened read-only for queries."""
    rng = random.Random(seed)
    source = sqlite3.connect(":memory:")
    source.executescript(SCHEMA)
    source.executemany("INSERT INTO departments VALUES (?, ?)", DEPARTMENTS)
    rows = [(i, FIRST_NAMES[i % len(FIRST_NAMES)] + str(i // len(FIRST_NAMES)), rng.choice(DEPARTMENTS)[0],
             rng.randrange(30, 150) * 1000, rng.randrange(21, 65)) for i in range(60)]
    source.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", rows)
    source.commit()
    db = sqlite3.connect(":memory:", check_same_thread=False)
    source.backup(db)
    source.close()
    db.execute("PRAGMA query_only = ON")
    return db


def run_query(db: sqlite3.Connection, sql: str, time_limit_s: float = TIME_LIMIT_S):
    """Rows of a single read-only statement, or None if it fails, writes, or runs past the limit."""
    if ";" in sql.strip().rstrip(";"):
        return None  # one statement only
    deadline = time.monotonic() + time_limit_s
    db.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        return db.execute(sql).fetchall()
    except sqlite3.Error:
        return None
    finally:
        db.set_progress_handler(None, 0)


def same_result(db: sqlite3.Connection, predicted: str, reference: str) -> bool:
    """Execution match: both queries run and return the same rows (as multisets, unless ORDER BY)."""
    want = run_query(db, reference)
    got = run_query(db, predicted)
    if want is None or got is None:
        return False
    if "order by" in reference.lower():
        return got == want
    return sorted(map(repr, got)) == sorted(map(repr, want))
