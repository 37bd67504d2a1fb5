"""docs/serving.md runs as written: the server from its start command, then every bash and python block."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

PAGE = Path(__file__).parent.parent / "docs" / "serving.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_serving_tutorial_commands_run(tmp_path):
    from test_serve import free_port, wait_healthy

    port = free_port()
    bash = [b.replace("8000", str(port)) for b in blocks("bash")]
    start, commands = bash[0].strip(), bash[1:]
    assert start.startswith("lorazor serve --testbed")
    proc = subprocess.Popen(start.split(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        for block in commands:
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (block, done.stderr)
            assert done.stdout.strip(), block
            assert '"error"' not in done.stdout, (block, done.stdout)
        for block in blocks("python"):
            code = block.replace("8000", str(port))
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (code, done.stderr)
            assert done.stdout.strip()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
