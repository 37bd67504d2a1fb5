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

from ..adapters import check_adapter_name
from .learned import LearnedRelease
from .profiled import ProfiledRelease

POLICY_FILE = "release_policy.json"
HEAD_FILE = "release_head.safetensors"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object like {{\"kind\": \"profiled\", \"k\": 3}}, "
                         f"got a {type(data).__name__}")
    return data


def _field(data: dict, key: str, path: Path):
    if key not in data:
        raise ValueError(f"{path} has no {key!r} field (found {sorted(data)})")
    return data[key]


def _read_head(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"learned release policy without its head: {path} is missing")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise ValueError(f"{path} is not a valid safetensors file ({err})") from err
    if set(tensors) != {"weight", "bias"}:
        raise ValueError(f"{path} must hold tensors 'weight' and 'bias', got {sorted(tensors)}")
    return tensors


def save_release_policy(policy, root: str | Path) -> list[Path]:
    """Write one `release_policy.json` (and head) per adapter of `policy` under `root/<adapter>/`."""
    root = Path(root)
    names = policy.lengths if isinstance(policy, ProfiledRelease) else getattr(policy, "heads", {})
    for name in names:
        check_adapter_name(name)
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
        check_adapter_name(name)
        path = root / name / POLICY_FILE
        if not path.exists():
            raise FileNotFoundError(f"adapter {name!r} has no {POLICY_FILE} in {path.parent}")
        data = _read_json(path)
        kind = _field(data, "kind", path)
        kinds.add(kind)
        if kind == "profiled":
            lengths[name] = _field(data, "k", path)
        elif kind == "learned":
            tau = _field(data, "tau", path)
            tensors = _read_head(root / name / HEAD_FILE)
            heads[name] = (tensors["weight"], float(tensors["bias"].reshape(-1)[0]), tau)
        else:
            raise ValueError(f"{path}: unknown policy kind {kind!r} (expected 'profiled' or 'learned')")
    if len(kinds) > 1:
        raise ValueError(f"adapters under {root} mix policy kinds {sorted(kinds)}")
    try:
        return ProfiledRelease(lengths) if lengths else LearnedRelease(heads)
    except (TypeError, ValueError) as err:
        raise ValueError(f"invalid release policy under {root}: {err}") from err
