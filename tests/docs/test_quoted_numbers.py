"""Numbers the README quotes come from one results file: its headline decode table equals
`benchmarks/results/e2e_targets_ee7bab4/llama_quick/` (the same run docs/performance.md tabulates)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "results" / "e2e_targets_ee7bab4" / "llama_quick" / "e2e_llama-3.2-3b_exact.json"


def k(tok_s: float) -> str:
    return f"{tok_s / 1000:.1f}k"


def test_readme_headline_equals_its_results_file():
    rows = json.loads(RUN.read_text())["rows"]
    pick = {(r["system"], r["L"]): r for r in rows}
    backbones = [r for r in rows if r["system"] == "lorazor_backbone"]
    backbone, compiled_backbone = backbones[0], backbones[1]
    exact, compiled = pick[("lorazor", 128)], pick[("lorazor_compiled", 128)]
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"\| LoRazor backbone only \| {k(backbone['decode_tok_s'])} \| "
                     rf"{k(compiled_backbone['decode_tok_s'])} \|", readme)
    assert (f"| LoRazor `exact` grid, 128 adapters | {k(exact['decode_tok_s'])} ({exact['vs_backbone']:.2f}x the "
            f"backbone) | {k(compiled['decode_tok_s'])} ({compiled['vs_backbone']:.2f}x) |") in readme
    performance = (ROOT / "docs" / "performance.md").read_text()
    assert f"| `exact`, CUDA graph | 128 | {round(exact['decode_tok_s'])} |" in performance
