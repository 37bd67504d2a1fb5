"""A small SQLite schema and a sandbox that scores text-to-SQL predictions by executing them.

A prediction is model output, so it is treated as hostile. Each query runs in a fresh in-memory
connection loaded from a pristine image of the database, so nothing one prediction does (a PRAGMA,
a write, a temp table) can change what the next one sees. Inside that connection an authorizer
allows only SELECTs that read the task's tables and call pure built-in functions: no PRAGMA,
ATTACH, writes, recursive CTEs or extensions. SQLite's own limits cap the size of any string or
blob (so one heavy operation such as `randomblob(5e8)` fails at once instead of running for
seconds), and a progress handler enforces the time limit.
"""

from __future__ import annotations

import random
import sqlite3
import time

SCHEMA = """
CREATE TABLE departments (name TEXT PRIMARY KEY, city TEXT NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept TEXT NOT NULL REFERENCES departments(name),
                        salary INTEGER NOT NULL, age INTEGER NOT NULL);
"""
TABLES = frozenset({"departments", "employees"})
DEPARTMENTS = [("sales", "paris"), ("research", "oslo"), ("support", "lima"), ("finance", "paris"), ("legal", "kyoto")]
FIRST_NAMES = ["ana", "ben", "chen", "dara", "eli", "fay", "gus", "hana", "ivo", "jun", "kai", "lea", "max", "nia",
               "omar", "pia", "raj", "sol", "tom", "uma", "vik", "wen", "yara", "zoe"]
# Abort a query after this long: a scorer must never hang on a model's runaway SQL.
TIME_LIMIT_S = 0.5
# Built-in functions a prediction may call: aggregates and pure scalar functions. Left out on
# purpose: randomblob/zeroblob/printf (large allocations), random, load_extension and the like.
ALLOWED_FUNCTIONS = frozenset({
    "count", "sum", "total", "avg", "min", "max", "group_concat", "abs", "round", "length", "lower", "upper",
    "substr", "substring", "trim", "ltrim", "rtrim", "coalesce", "ifnull", "nullif", "instr", "replace", "like",
    "glob", "iif", "typeof",
})
# Caps on what one query may build or return.
MAX_SQL_CHARS = 2000
MAX_VALUE_BYTES = 100_000
MAX_ROWS = 1000
# Check the deadline every this many SQLite VM instructions.
PROGRESS_EVERY = 100


def _authorizer(tables: frozenset):
    """An SQLite authorizer that allows SELECTs reading `tables` and calling allowed functions."""
    def authorize(action, arg1, arg2, db_name, trigger):
        if action == sqlite3.SQLITE_SELECT:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_READ and arg1 in tables:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and arg2 is not None and arg2.lower() in ALLOWED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY
    return authorize


def _fill_v1(rng: random.Random) -> dict[str, list[tuple]]:
    rows = [(i, FIRST_NAMES[i % len(FIRST_NAMES)] + str(i // len(FIRST_NAMES)), rng.choice(DEPARTMENTS)[0],
             rng.randrange(30, 150) * 1000, rng.randrange(21, 65)) for i in range(60)]
    return {"departments": DEPARTMENTS, "employees": rows}


class TaskDatabase:
    """The task's database (deterministic for a seed) and a sandboxed, read-only query runner.

    Thread-safe: every query gets its own connection.

    Args:
        seed: seeds the rows.
        schema, tables, fill: the DDL, the tables predictions may read, and `fill(rng)` ->
            {table: rows}; the defaults are the v1 testbed's employees and departments.
    """

    def __init__(self, seed: int = 0, schema: str = SCHEMA, tables: frozenset = TABLES, fill=_fill_v1):
        rng = random.Random(seed)
        source = sqlite3.connect(":memory:")
        source.executescript(schema)
        for table, rows in fill(rng).items():
            if rows:
                source.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        source.commit()
        self._authorize = _authorizer(frozenset(tables))
        self._image = source.serialize()
        source.close()

    def _sandbox(self, deadline: float) -> sqlite3.Connection:
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.deserialize(self._image)
        db.execute("PRAGMA query_only = ON")
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        db.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
        db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        db.set_authorizer(self._authorize)
        db.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_EVERY)
        return db

    def run(self, sql: str, time_limit_s: float = TIME_LIMIT_S):
        """Rows of one read-only statement, or None if it is refused, fails, or runs past the limit."""
        if len(sql) > MAX_SQL_CHARS or ";" in sql.strip().rstrip(";"):
            return None  # one statement only
        db = self._sandbox(time.monotonic() + time_limit_s)
        try:
            rows = db.execute(sql).fetchmany(MAX_ROWS + 1)
            return rows if len(rows) <= MAX_ROWS else None
        except (sqlite3.Error, OverflowError, MemoryError):
            return None
        finally:
            db.close()


def build_database(seed: int = 0) -> TaskDatabase:
    """The task's database for a seed; query it with `run_query`."""
    return TaskDatabase(seed)


def run_query(db: TaskDatabase, sql: str, time_limit_s: float = TIME_LIMIT_S):
    """Rows of a single read-only statement, or None if it is refused, fails, or runs past the limit."""
    return db.run(sql, time_limit_s)


def same_result(db: TaskDatabase, predicted: str, reference: str) -> bool:
    """Execution match: both queries run and return the same rows (as multisets, unless ORDER BY)."""
    want = run_query(db, reference)
    got = run_query(db, predicted)
    if want is None or got is None:
        return False
    if "order by" in reference.lower():
        return got == want
    return sorted(map(repr, got)) == sorted(map(repr, want))
