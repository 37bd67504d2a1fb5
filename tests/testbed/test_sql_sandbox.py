"""The testbed's SQL scorer treats predictions as hostile: read-only, isolated, bounded."""

import time

import pytest
from lorazor.testbed.v1.tasks import make_tasks
from lorazor.testbed.sql import build_database, run_query

COUNT = "SELECT COUNT(*) FROM employees"


@pytest.fixture()
def db():
    return build_database()


@pytest.mark.parametrize("attack", [
    "PRAGMA query_only = OFF",
    "PRAGMA writable_schema = ON",
    "DELETE FROM employees",
    "UPDATE employees SET salary = 0",
    "CREATE TEMP TABLE t(x)",
    "DROP TABLE employees",
    "SELECT load_extension('x')",
    "SELECT * FROM sqlite_master",
])
def test_statements_other_than_reads_are_refused_and_change_nothing(db, attack):
    assert run_query(db, attack) is None
    assert run_query(db, COUNT) == [(60,)]


def test_pragma_then_delete_cannot_change_the_next_query(db):
    run_query(db, "PRAGMA query_only = OFF")
    run_query(db, "DELETE FROM employees")
    assert run_query(db, COUNT) == [(60,)]


def test_attach_creates_no_file_and_writes_nothing(db, tmp_path):
    target = tmp_path / "written.db"
    assert run_query(db, f"ATTACH DATABASE '{target}' AS x") is None
    assert not target.exists()
    run_query(db, f"ATTACH DATABASE '{target}' AS x; CREATE TABLE x.t(a); INSERT INTO x.t VALUES ('data')")
    assert not target.exists()


@pytest.mark.parametrize(
    "heavy",
    [
        "SELECT randomblob(500000000)",
        "SELECT zeroblob(500000000)",
        "SELECT printf('%.*c', 500000000, 'x')",
        "SELECT replace(replace(replace(replace(hex(name), '', ''), "
        "'A', 'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'), "
        "'A', 'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'), "
        "'A', 'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA') FROM employees",
        "WITH RECURSIVE r(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM r LIMIT 40) SELECT length(s) FROM r",
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT COUNT(*) FROM r",
    ],
)
def test_heavy_queries_fail_fast(db, heavy):
    start = time.monotonic()
    assert run_query(db, heavy) is None
    # The time limit is 0.5 s; a single huge allocation must not escape it.
    assert time.monotonic() - start < 1.5


def test_cross_join_is_stopped_by_the_time_limit(db):
    start = time.monotonic()
    big = "SELECT COUNT(*) FROM employees a, employees b, employees c, employees d, employees e"
    assert run_query(db, big, time_limit_s=0.1) is None
    assert time.monotonic() - start < 1.0


def test_a_scored_prediction_cannot_change_later_scores():
    task = make_tasks()["sql"]
    examples = task.split("validation")[:50]
    empty = " SELECT name FROM employees WHERE 0"
    before = sum(task.score(empty, ex) for ex in examples)
    for attack in (" PRAGMA query_only = OFF", " DELETE FROM employees", " DROP TABLE departments"):
        assert not task.score(attack, examples[0])
    assert sum(task.score(empty, ex) for ex in examples) == before
    assert all(task.score(" " + ex["reference"], ex) for ex in examples)
