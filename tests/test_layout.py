"""The package's architecture, held by tests: layers import only layers below them, no import
cycles, a small package root, and no function too long to read (docs/design.md). The import graph
comes from `benchmarks/probes/structure.py`, which prints the same numbers."""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "lorazor"
KERNELS = ROOT / "kernels" / "lorazor_kernels"

# Bottom to top: a package may import those before it, never those after it. The package root
# (`lorazor`: public names and `__version__`) may be imported from anywhere.
LAYERS = ["lorazor_kernels", "lorazor.config", "lorazor.lora", "lorazor.adapters", "lorazor.policies", "lorazor.quant",
          "lorazor.runner", "lorazor.model", "lorazor.engine", "lorazor.calibration", "lorazor.testbed",
          "lorazor.serve", "lorazor.ray", "lorazor.tiny", "lorazor.cli", "lorazor.__main__"]
MAX_ROOT_MODULES = 6
MAX_FUNCTION_LINES = 120


def structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks" / "probes" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def graph():
    return structure().import_graph({"lorazor": SRC, "lorazor_kernels": KERNELS})


def layer_of(module: str) -> str | None:
    return next((layer for layer in sorted(LAYERS, key=len, reverse=True)
                 if module == layer or module.startswith(layer + ".")), None)


def test_every_package_has_a_layer(graph):
    assert not {m for m in graph if m != "lorazor" and layer_of(m) is None}


def test_layers_import_only_layers_below(graph):
    wrong = []
    for module, targets in graph.items():
        own = layer_of(module)
        for target in targets:
            other = layer_of(target)
            if module == "lorazor" or target == "lorazor" or other is None or own == other:
                continue
            if LAYERS.index(other) > LAYERS.index(own):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


@pytest.mark.parametrize("upper, lower", [("lorazor.runner", "lorazor.lora"), ("lorazor.adapters", "lorazor.lora"),
                                          ("lorazor.testbed", "lorazor.calibration"), ("lorazor.ray", "lorazor.serve"),
                                          ("lorazor.engine", "lorazor.model")])
def test_the_named_arrows_point_down(graph, upper, lower):
    """The arrows DESIGN.md names are in the import graph, and none of them points back up: the
    runner above the LoRA layers, the adapter files above the slots they fill, the testbed plugging
    into calibration, Ray above the server, the engine above the model."""
    down = [m for m, targets in graph.items() if layer_of(m) == upper and any(layer_of(t) == lower for t in targets)]
    up = [f"{m} imports {t}" for m, targets in graph.items() if layer_of(m) == lower
          for t in targets if layer_of(t) == upper]
    assert down and not up, up


@pytest.mark.parametrize("importer, package", [("lorazor.engine", "lorazor.runner"),
                                               ("lorazor.serve", "lorazor.engine")])
def test_a_package_is_used_through_its_public_names_only(graph, importer, package):
    """The engine takes the runner's names from `lorazor.runner` (its `__init__`), never from its
    modules; the server takes the engine's from `lorazor.engine`."""
    assert structure().internal_imports(graph, importer, package) == []


def test_no_import_cycles(graph):
    probe = structure()
    assert probe.cycles(graph) == []
    assert probe.package_cycles(graph) == []


def test_the_slots_import_no_adapter_files(graph):
    assert not [t for t in graph["lorazor.lora.bank"] if t.startswith("lorazor.adapters")]


def test_kernels_know_nothing_about_models():
    for path in KERNELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert name.split(".")[0] not in ("lorazor", "transformers", "peft"), f"{path.name} imports {name}"


def test_the_package_root_holds_few_modules():
    modules = sorted(p.name for p in SRC.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules


def test_no_function_is_longer_than_a_screenful():
    longest = structure().longest_functions([SRC, ROOT / "kernels"], top=3)
    assert longest[0][0] <= MAX_FUNCTION_LINES, longest


def test_file_names_have_one_meaning():
    """A module name appears once in the package (`__init__`, `cli` and `__main__` aside; the old
    testbed's folder `testbed/v1/` keeps the names of the shipped testbed's modules it mirrors)."""
    seen: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name not in ("__init__.py", "cli.py", "__main__.py") and "v1" not in path.relative_to(SRC).parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(SRC)))
    assert not {name: where for name, where in seen.items() if len(where) > 1}


def test_comments_cite_only_files_in_the_tree():
    """A path into the repository named in a comment or docstring (`tests/...`, `benchmarks/...`) exists."""
    import re

    cited = re.compile(r"(?<![\w/.])((?:src|tests|benchmarks|docs|kernels|examples)/[\w./-]+\.(?:py|md|json|jsonl|sh))")
    missing = []
    for path in [*SRC.rglob("*.py"), *KERNELS.rglob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            missing += [f"{path.relative_to(ROOT)}:{number} {name}" for name in cited.findall(line)
                        if not (ROOT / name).exists()]
    assert not missing, missing
