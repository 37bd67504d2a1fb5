"""Save and load release policies beside each adapter: `release_policy.json` (+ safetensors heads).

Layout, one folder per adapter (PEFT's `save_pretrained` layout puts each adapter in its own folder):
    <root>/<adapter>/release_policy.json      {"kind": "profiled", "k": 3}  or  {"kind": "learned", "tau": ...}
    <root>/<adapter>/release_head.safetensors {"weight": [H], "bias": [1]}   (learned only)
Nothing is pickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .learned import LearnedRelease
from .profiled import ProfiledRelease

POLICY_FILE = "release_policy.json"
HEAD_FILE = "release_head.safetensors"


def save_release_policy(policy, root: str | Path) -> list[Path]:
    """Write one `release_policy.json` (and head) per adapter of `policy` under `root/<adapter>/`."""
    root = Path(root)
    written = []
    if isinstance(policy, ProfiledRelease):
        for name, k in policy.lengths.items():
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / POLICY_FILE).write_text(json.dumps({"kind": "profiled", "k": k}, indent=2))
            written.append(folder / POLICY_FILE)
    elif isinstance(policy, LearnedRelease):
        for name, (w, b, tau) in policy.heads.items():
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / POLICY_FILE).write_text(json.dumps({"kind": "learned", "tau": float(tau)}, indent=2))
            save_file({"weight": w.detach().float().contiguous().cpu(), "bias": torch.tensor([float(b)])},
                      str(folder / HEAD_FILE))
            written.append(folder / POLICY_FILE)
    else:
        raise TypeError(f"cannot save a {type(policy).__name__}: only ProfiledRelease and LearnedRelease")
    return written


def load_release_policy(root: str | Path, adapters: list[str] | None = None):
    """Load the policy saved under `root/<adapter>/` for every adapter folder found (or `adapters`).

    All adapters must use the same kind of policy. Returns a `ProfiledRelease` or `LearnedRelease`.
    """
    root = Path(root)
    names = adapters if adapters is not None else sorted(p.parent.name for p in root.glob(f"*/{POLICY_FILE}"))
    if not names:
        raise FileNotFoundError(f"no */{POLICY_FILE} under {root}")
    kinds, lengths, heads = set(), {}, {}
    for name in names:
        path = root / name / POLICY_FILE
        if not path.exists():
            raise FileNotFoundError(f"adapter {name!r} has no {POLICY_FILE} in {path.parent}")
        data = json.loads(path.read_text())
        kind = data.get("kind")
        kinds.add(kind)
        if kind == "profiled":
            lengths[name] = data["k"]
        elif kind == "learned":
            tensors = load_file(str(root / name / HEAD_FILE))
            heads[name] = (tensors["weight"], float(tensors["bias"][0]), float(data["tau"]))
        else:
            raise ValueError(f"{path}: unknown policy kind {kind!r} (expected 'profiled' or 'learned')")
    if len(kinds) > 1:
        raise ValueError(f"adapters under {root} mix policy kinds {sorted(kinds)}")
    return ProfiledRelease(lengths) if lengths else LearnedRelease(heads)
