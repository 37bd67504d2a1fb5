"""The package's structure as numbers (CPU, a few seconds): what issue #53 asks to see before and after.

    python benchmarks/probes/structure.py [--src src/lorazor] [--json out.json]

- root modules: `.py` files directly under `src/lorazor/`;
- import cycles: strongly connected groups of modules in the import graph (module level and
  function level imports alike, `TYPE_CHECKING` imports excluded);
- the longest functions in `src/` and `kernels/`;
- the files one request crosses from HTTP to the kernel and back: a completion through the
  server app on the shipped testbed (CPU, the engine on a thread), every `lorazor` and
  `lorazor_kernels` file whose code ran while it was served (after a warm-up request), by a
  profile hook on every thread.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, base: Path, package: str) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules `path` (module `name`) imports; `from . import x` names module `x`, not the package."""
    tree = ast.parse(path.read_text())
    skip = type_checking_lines(tree)
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            out |= subs if len(subs) == len(node.names) else subs | {target}
    return out


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = {}
    for package, base in packages.items():
        for path in base.rglob("*.py"):
            files[module_name(path, base, package)] = path
    graph = {}
    for name, path in files.items():
        targets = imports_of(path, name, path.name == "__init__.py", set(files))
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def internal_imports(graph: dict[str, set[str]], importer: str, package: str) -> list[str]:
    """Imports by modules of package `importer` of `package`'s modules other than its `__init__`
    (its public names), as "module -> target"."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == importer or m.startswith(importer + ".")
                  for t in targets if t.startswith(package + "."))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def package_cycles(graph: dict[str, set[str]], depth: int = 2) -> list[list[str]]:
    """Cycles between subpackages (`lorazor.serve` <-> `lorazor.ray`), root modules counting alone."""
    def key(m):
        return ".".join(m.split(".")[:depth])

    coarse: dict[str, set[str]] = {}
    for v, targets in graph.items():
        coarse.setdefault(key(v), set()).update(key(t) for t in targets if key(t) != key(v))
    return cycles(coarse)


def longest_functions(folders: list[Path], top: int = 5) -> list[tuple[int, str]]:
    found = []
    for folder in folders:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((node.end_lineno - node.lineno + 1,
                                  f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)[:top]


def request_path() -> list[str]:
    """The project files whose code ran while one completion was served (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    from fastapi.testclient import TestClient

    from lorazor import LoRazorEngine, LoRazorModel
    from lorazor.serve import build_app
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    engine = LoRazorEngine(LoRazorModel.from_peft(peft_model), max_num_seqs=4, num_kv_blocks=64)
    body = {"model": "sql", "prompt": tasks["sql"].split("test")[0]["prompt"], "max_tokens": 4, "temperature": 0}
    seen: set[str] = set()
    marks = (f"{Path('src') / 'lorazor'}", f"{Path('kernels') / 'lorazor_kernels'}")

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if any(m in name for m in marks):
                seen.add(name)

    # Set before the app's threads start (the server's event loop, the engine's thread), so they run
    # with it; what the warm-up request touched is forgotten.
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with TestClient(build_app(engine, tokenizer, model_name="testbed")) as http:
            http.post("/v1/completions", json=body)  # warm-up: the engine's thread starts, first compiles
            seen.clear()
            assert http.post("/v1/completions", json=body).status_code == 200
            found = set(seen)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    seen = found
    return sorted(str(Path(p).resolve().relative_to(ROOT)) for p in seen)


def package_of(filename: str) -> str | None:
    """`lorazor.<package>` (or `lorazor_kernels`, or `lorazor` for a root module) of a project file."""
    parts = Path(filename).resolve().parts
    for root, name in (("lorazor", "lorazor"), ("lorazor_kernels", "lorazor_kernels")):
        if root in parts:
            rest = parts[parts.index(root) + 1:]
            if name == "lorazor_kernels" or len(rest) == 1:
                return name
            return f"{name}.{rest[0]}"
    return None


def step_crossings() -> list[str]:
    """The package borders one decode step of the engine crosses (CPU, the testbed: an adapter row and
    a backbone row): each distinct "caller module -> callee module" call between two packages."""
    import torch

    torch.set_num_threads(1)
    from lorazor import LoRazorEngine, LoRazorModel
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    engine = LoRazorEngine(LoRazorModel.from_peft(peft_model), max_num_seqs=4, num_kv_blocks=64)
    prompt = tokenizer(tasks["sql"].split("test")[0]["prompt"])["input_ids"]
    for adapter in ("sql", None):
        engine.add_request(prompt, adapter=adapter, max_new_tokens=16, eos_token_id=None)
    for _ in range(3):  # the prefill and the first decode steps (compiles, first uploads)
        engine.step()
    edges: set[str] = set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        a, b = package_of(caller), package_of(callee)
        if a and b and a != b and "lorazor" in caller and "lorazor" in callee:
            edges.add(f"{module_of(caller)} -> {module_of(callee)}")

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    engine.abort_all()
    return sorted(edges)


def module_of(filename: str) -> str:
    parts = Path(filename).resolve().with_suffix("").parts
    root = "lorazor_kernels" if "lorazor_kernels" in parts else "lorazor"
    return ".".join(parts[parts.index(root):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, default=ROOT / "src" / "lorazor")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-request", action="store_true", help="skip the request trace")
    args = ap.parse_args()
    packages = {"lorazor": args.src, "lorazor_kernels": ROOT / "kernels" / "lorazor_kernels"}
    graph = import_graph(packages)
    report = dict(
        root_modules=sorted(p.name for p in args.src.glob("*.py")),
        module_cycles=cycles(graph),
        package_cycles=package_cycles(graph),
        longest_functions=longest_functions([args.src, ROOT / "kernels"]),
        engine_imports_runner_internals=internal_imports(graph, "lorazor.engine", "lorazor.runner"),
        serve_imports_engine_internals=internal_imports(graph, "lorazor.serve", "lorazor.engine"),
        lora_imports_adapters=sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("lorazor.lora")
                                     for t in ts if t.startswith("lorazor.adapters")),
    )
    if not args.no_request:
        report["request_files"] = request_path()
        report["decode_step_crossings"] = step_crossings()
    print(f"root modules: {len(report['root_modules'])} {report['root_modules']}")
    print(f"module cycles: {len(report['module_cycles'])} {report['module_cycles']}")
    print(f"package cycles: {len(report['package_cycles'])} {report['package_cycles']}")
    print(f"longest functions: {report['longest_functions']}")
    for key in ("engine_imports_runner_internals", "serve_imports_engine_internals", "lora_imports_adapters",
                "decode_step_crossings"):
        if key in report:
            print(f"{key.replace('_', ' ')}: {len(report[key])} {report[key]}")
    if "request_files" in report:
        print(f"files on one request's path (HTTP -> kernel -> HTTP): {len(report['request_files'])}")
        for f in report["request_files"]:
            print(f"  {f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
