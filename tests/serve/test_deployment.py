"""The Dockerfile's command is a valid `lorazor serve` command line (the image itself is not built
in CI), and every file it copies exists."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_command_parses_and_its_copies_exist():
    from lorazor.cli import build_parser

    text = (ROOT / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry[0] == "lorazor"
    args = build_parser().parse_args(entry[1:] + cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000 and args.testbed
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for name in source.split():
            assert (ROOT / name).exists(), name
