"""Shared benchmark helpers: shapes registry, environment record, timing, bandwidth."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

# (K, N) of the 7 LoRA-targeted projections of one decoder layer.
SHAPES = {
    "llama-3.2-3b": dict(hidden=3072, inter=8192, heads=24, kv_heads=8, head_dim=128, layers=28, vocab=128256),
    "mistral-7b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, layers=32, vocab=32768),
}


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    h, i = shape["hidden"], shape["inter"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def commit() -> str:
    """The tree's commit: `$LORAZOR_COMMIT` if set (give it literally: a device machine may hold a copy of the
    tree whose .git names an older HEAD), else git's HEAD with "+dirty" when tracked files differ from it, so a
    result never names a commit its tree was not."""
    sha = os.environ.get("LORAZOR_COMMIT", "")
    if sha:
        return sha
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True).stdout.strip()
    except OSError:
        return "unknown"
    return f"{sha}+dirty" if sha and changed else sha or "unknown"


def environment() -> dict:
    """Commit, GPU and package versions, recorded with every result."""
    import transformers
    import triton

    env = {"commit": commit(), "python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__}
    try:
        import peft

        env["peft"] = peft.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        from lorazor_kernels.kernel_config import kernel_config_path

        # Which launch settings the LoRA kernels ran with (a GPU without a tuned file gets the default).
        env["kernel_config"] = Path(kernel_config_path(torch.device("cuda"))).name
    return env


def timed(fn, reps: int = 1) -> float:
    """Wall-clock seconds per call of `fn`, synchronizing the GPU (if any) around the calls."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def time_graph(fn, warmup: int = 3, iters: int = 50) -> float:
    """Median milliseconds of `fn` captured in a CUDA graph and replayed (launch gaps removed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + written), a 4 GB copy."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.float16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_graph(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def write_results(out_dir: Path, name: str, rows: list[dict], meta: dict, table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out_dir / f"{name}.md").write_text(table)


@contextlib.contextmanager
def mask_timer():
    """Host ms of each grammar-mask fill and upload (`runner.grammar.apply_masks` as the engine's
    steps call it), appended to the yielded list while the block runs (empty for a build without
    structured outputs: an A/B against an older commit)."""
    import importlib

    try:  # where the engine's steps call it (older trees: the engine module)
        engine_module = importlib.import_module("lorazor.runner.paged_steps")
    except ImportError:
        engine_module = importlib.import_module("lorazor.engine.engine")
    original, spent = getattr(engine_module, "apply_masks", None), []
    if original is None:
        yield spent
        return

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - start) * 1e3)

    engine_module.apply_masks = timed
    try:
        yield spent
    finally:
        engine_module.apply_masks = original

