"""Every script in examples/ runs on the CPU (with a small setting where it takes one)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
SMALL = {"calibrate_release.py": ["--examples", "8"]}


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES.parent / "src"),
                                                                    str(EXAMPLES.parent / "kernels"),
                                                                    os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *SMALL.get(script, [])], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
