"""docs/serving.md runs as written: the server from its start command, then every bash and python block."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.mark.slow
def test_serving_tutorial_commands_run(tmp_path):
    from servers import free_port, start_serve_command, stop_process_group, wait_healthy

    port = free_port()
    bash = [b.replace("8000", str(port)) for b in blocks("bash")]
    start, commands = bash[0].strip(), bash[1:]
    assert start.startswith("lorazor serve --testbed")
    # `python -m lorazor`: the command as written, without needing `lorazor` on PATH.
    proc = start_serve_command(*start.split()[2:])
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        for block in commands:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, (block, done.stderr)
            assert done.stdout.strip(), block
            assert '"error"' not in done.stdout, (block, done.stdout)
        for block in blocks("python"):
            code = block.replace("8000", str(port))
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (code, done.stderr)
            assert done.stdout.strip()
    finally:
        stop_process_group(proc, timeout=30)


def test_the_flag_table_states_the_commands_defaults():
    """Every flag of `lorazor serve` is in the page's table, and a default written as code there is
    the parser's own."""
    import argparse

    from lorazor.serve.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rows = {
        m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]*) \|", PAGE.read_text(), re.M)
    }
    flags = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(rows) == set(flags), set(rows) ^ set(flags)
    for flag, default in flags.items():
        written = re.fullmatch(r"`([^`]*)`", rows[flag].strip())
        if written:
            assert written.group(1) == str(default), (flag, written.group(1), default)
