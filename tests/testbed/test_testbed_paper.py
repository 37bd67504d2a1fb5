"""The paper-tables command (`python -m lorazor.testbed.paper`): its cutoff rule, and a quick run
end to end on the shipped testbed."""

import importlib.util
import json

import pytest

from lorazor.testbed.paper import LENGTHS, safe_cutoffs

pytestmark = pytest.mark.slow


def test_safe_cutoff_is_the_first_k_from_which_every_later_k_stays_correct():
    full = [True, True, True, False, True]
    by_k = {0: [True, False, False, True, False],
            4: [True, True, False, True, False],
            16: [True, False, True, True, False],
            64: [True, True, True, True, False]}
    # request 1 fails at k=16, so only 64 is safe; request 3 is wrong under full LoRA and left out
    assert safe_cutoffs(full, by_k) == [0, 64, 16, None]


def test_paper_tables_run_end_to_end_in_limit_mode(tmp_path):
    from lorazor.testbed.paper import main

    main(["--out", str(tmp_path), "--limit", "6", "--train-limit", "6", "--tasks", "science,sql", "--batch", "6",
          "--docs", str(tmp_path / "docs")])
    data = json.loads((tmp_path / "paper_tables.json").read_text())
    assert [r["task"] for r in data["tasks"]] == ["science", "sql"]
    for r in data["tasks"]:
        assert 0 <= r["full"] <= 1 and 0 <= r["backbone"] <= 1
        assert sorted(int(k) for k in r["curve"]) == list(LENGTHS)
        assert set(r["table1"]) == {"training-free (k, >=50% skip)", "learned P25", "learned P50", "learned P75"}
        assert r["table4"]["profiled"] is not None and r["table4"]["learned"] is not None  # full LoRA always qualifies
        assert all(c is None or c in LENGTHS for c in r["cutoffs"])
        assert r["curve"]["0"]["skip"] == 1.0  # releasing before the first decode step skips every decode call
    text = (tmp_path / "paper_tables.md").read_text()
    assert "## Table 1" in text and "## Table 4" in text and "| science |" in text
    assert data["meta"]["stage_seconds"] and "lorazor.testbed.paper" in data["meta"]["command"]
    figures = sorted(p.name for p in tmp_path.glob("fig*.png"))
    assert sorted(p.name for p in (tmp_path / "docs").glob("*.png")) == figures
    if importlib.util.find_spec("matplotlib"):
        assert figures == ["fig13_pareto.png", "fig14_cutoffs.png", "fig2_release_step.png"]


def test_bad_counts_are_refused_naming_the_value(capsys):
    import pytest

    from lorazor.testbed.paper import main

    for flag in ("--batch", "--limit", "--train-limit"):
        with pytest.raises(SystemExit):
            main(["--out", "/tmp/unused", flag, "0"])
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
