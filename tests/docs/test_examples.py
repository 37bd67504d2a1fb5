"""Every script in examples/ runs on the CPU (with a small setting where it takes one)."""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
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


def test_benchmark_logic_runs_on_a_tiny_model(tmp_path):
    """The user-facing benchmarks' model plumbing (bench_release --tiny; bench_e2e's random adapters)."""
    root = EXAMPLES.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "kernels"), str(root / "benchmarks")]),
    }
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_release.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check = (
        "import torch; from lorazor import LoRazorConfig, LoRazorModel; from lorazor.tiny import tiny_peft_model;"
        "from bench_e2e import assign, fill_random_adapters;"
        "m = LoRazorModel.from_peft(tiny_peft_model(), LoRazorConfig(max_loras=6));"
        "names = m.adapter_names + fill_random_adapters(m, 3, 3);"
        "assert [m.adapters[n].location for n in names] == ['gpu'] * 6, m.adapters;"
        "m.generate(torch.randint(3, 90, (6, 4)), adapter_ids=assign(6, 6, names), max_new_tokens=2, pad_token_id=0)"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def test_moe_benchmark_runs_on_a_tiny_moe(tmp_path):
    """bench_moe.py --tiny: decode rows at two batch sizes and the trace, each row with its floors."""
    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "kernels")])}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_moe.py"), "--tiny", "--out", str(tmp_path),
                           "--phases", "decode,trace", "--batches", "1,3", "--layers", "2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    decode = [r for r in rows if r["phase"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 3]
    assert all(r["backbone_ms"] > 0 and r["lora_floor_ms"] > r["backbone_floor_ms"] > 0 for r in decode)
    assert [r["system"] for r in rows if r["phase"] == "trace"] == ["backbone", "exact", "steptrim"]
    assert not [r for r in rows if r["phase"] == "prefill"]
    # --quantization fp8: fp8 experts, the floors counting one byte per decoder weight
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_moe.py"), "--tiny", "--out",
                           str(tmp_path / "fp8"), "--phases", "decode", "--batches", "1", "--layers", "2",
                           "--quantization", "fp8"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    fp8 = next(r for r in json.loads((tmp_path / "fp8" / "moe.json").read_text())["rows"] if r["phase"] == "decode")
    assert 0 < fp8["backbone_floor_ms"] <= decode[0]["backbone_floor_ms"] and fp8["backbone_ms"] > 0
    spec = importlib.util.spec_from_file_location("bench_moe", root / "benchmarks" / "bench_moe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = types.SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                  moe_intermediate_size=6, num_experts=4, vocab_size=10)
    # bf16: 2 bytes each; fp8: projections and experts 1 byte, router and LM head 2 (2 layers, 3 and 1 experts)
    projections, experts, rest = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8), 3 * 8 * 6 * 4, 2 * 4 * 8 + 10 * 8
    assert bench.weight_bytes(shape, [3, 1]) == 2 * (projections + experts + rest)
    assert bench.weight_bytes(shape, [3, 1], decoder_element=1) == projections + experts + 2 * rest


def test_trace_probe_counts_every_step_of_a_tiny_trace(tmp_path):
    """probes/trace_busy.py --tiny: every request runs, and each step is counted once, by its kind."""
    import json

    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "kernels")])}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "probes" / "trace_busy.py"), "--tiny",
                           "--requests", "16", "--workload", "decode-heavy", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "trace_busy.json").read_text())
    kinds = result["by_kind"]
    assert result["requests"] == 16 and result["workload"] == "decode-heavy"
    assert kinds["decode"]["steps"] + kinds["mixed"]["steps"] == result["steps"] > 0
    assert kinds["decode"]["tokens_mean"] <= result["max_num_seqs"] < kinds["mixed"]["tokens_mean"]


def test_host_trace_probe_counts_every_token_of_the_trace(tmp_path):
    """probes/host_trace.py: its steps hold every prompt token and every decode token of the trace,
    and no step holds more than the engine's budgets."""
    import json

    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "kernels")])}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "probes" / "host_trace.py"), "--requests", "48",
                           "--adapters", "8", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    sys.path.insert(0, str(root / "benchmarks"))
    import engine_workload as wl

    workload = wl.build(48, 256)  # the probe's: 48 requests over its tiny model's 256-token vocabulary
    result = json.loads((tmp_path / "host_trace.json").read_text())
    c = result["composition"]
    assert c["prefill_tokens"] == sum(len(r.prompt) for r in workload)
    # The first token of a request comes from its last prefill chunk; each further one is a decode row.
    assert c["decode_tokens"] == sum(r.max_new_tokens - 1 for r in workload)
    assert c["steps"] == result["steps"] and c["running_mean"] <= 16 and c["tokens_mean"] <= 512
    assert max(int(b) for b in c["steps_by_token_bucket"]) <= 512


@pytest.mark.parametrize("model", ["--testbed", "--tiny"])
def test_serving_benchmark_runs_on_the_cpu(tmp_path, model):
    """bench_serving.py end to end on the CPU: the same arrivals in process and over HTTP (a server
    on 127.0.0.1 that the benchmark starts and stops); --tiny runs the GPU run's code path (random
    model, token-id text, the engine benchmark's setup)."""
    import json

    pytest.importorskip("uvicorn")  # the `serve` extra
    pytest.importorskip("fastapi")
    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), str(root / "kernels"),
                                                                     str(root / "benchmarks"),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_serving.py"), model, "--rates", "3,6",
                           "--seconds", "1.5", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "serving.json").read_text())["rows"]
    assert sorted((r["rate"], r["path"]) for r in rows) == [(3.0, "http"), (3.0, "in_process"), (6.0, "http"),
                                                            (6.0, "in_process")]
    # Both paths served every request that arrived.
    for rate in (3.0, 6.0):
        assert len({r["completed"] for r in rows if r["rate"] == rate}) == 1


def test_engine_benchmark_runs_end_to_end_on_a_tiny_model(tmp_path):
    """bench_engine.py --tiny: both parts (every stage: offline sweep, backbone, skewed, open loop,
    static generate) and the render, on the CPU, also on a GPU machine (on the H100 the run on the
    GPU was still going after 150 s and took its shard past the time limit; the logic is the same)."""
    import json

    root = EXAMPLES.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "kernels"), str(root / "benchmarks")]),
        "CUDA_VISIBLE_DEVICES": "",
    }
    script = str(root / "benchmarks" / "bench_engine.py")
    for part in ("exact", "full"):
        done = subprocess.run(
            [
                sys.executable,
                script,
                "--tiny",
                "--part",
                part,
                "--requests",
                "16",
                "--adapters",
                "4,8",
                "--rates",
                "40",
                "--open-seconds",
                "0.3",
                "--out",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        json.loads(line) for p in ("exact", "full") for line in (tmp_path / f"rows_{p}.jsonl").read_text().splitlines()
    ]
    stages = {(r["stage"], r["system"]) for r in rows}
    assert {("offline", "lorazor"), ("offline", "exact"), ("offline", "full"), ("offline", "full_release"),
            ("backbone", "backbone"), ("skewed", "lorazor"), ("skewed", "full"), ("open", "lorazor"), ("open", "full"),
            ("offline", "static")} <= stages, stages
    assert all(r["completed"] > 0 for r in rows if r["stage"] == "open")
    at_most = {r["system"]: r["req_s"] for r in rows if r["stage"] in ("offline", "backbone") and r["L"] in (0, 8)}
    summary = next(r for r in rows if r["stage"] == "summary")
    gap = (at_most["lorazor"] - at_most["exact"]) / (at_most["backbone"] - at_most["exact"])
    assert summary["gap_closed"] == pytest.approx(gap, abs=1e-4)
    assert summary["vs_backbone"] == pytest.approx(at_most["lorazor"] / at_most["backbone"], abs=1e-4)
    done = subprocess.run([sys.executable, script, "--render", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 8 |" in (tmp_path / "engine.md").read_text()


def test_decode_heavy_workload_has_the_shape_of_the_steptrim_trace():
    # Issue #37's StepTrim trace: prompts with a median near 197 tokens, outputs near 151, and
    # release lengths that skip at least 73% of decode LoRA; the paper's mixed workload keeps 50%.
    import numpy as np

    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import engine_workload as wl

    heavy, mixed = wl.build(1536, 32000, shape="decode-heavy"), wl.build(1536, 32000)
    assert 185 <= np.median([len(r.prompt) for r in heavy]) <= 210
    assert 140 <= np.median([r.max_new_tokens for r in heavy]) <= 160
    assert np.median([r.max_new_tokens for r in mixed]) < 60
    for workload, shape in ((heavy, "decode-heavy"), (mixed, "mixed")):
        ks = wl.release_lengths(workload, wl.TARGET_SKIPS[shape])
        skip = wl.skip_fraction(workload, ks)
        assert wl.TARGET_SKIPS[shape] <= skip < wl.TARGET_SKIPS[shape] + 0.03, (shape, skip)
        assert max(len(r.prompt) + r.max_new_tokens for r in workload) <= 1024  # bench_engine's max_model_len
    with pytest.raises(ValueError, match="unknown workload shape 'long'"):
        wl.build(16, 100, shape="long")


def test_cold_adapter_bench_classes_every_request_of_a_tiny_trace(tmp_path):
    """bench_cold_adapters.py --tiny: every request is served and classed by where its adapter was
    (slot, host copy, disk), and the resident baseline serves the same trace from slots only."""
    import json

    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "kernels")])}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_cold_adapters.py"), "--tiny",
                           "--adapters", "40", "--max-loras", "4", "--max-cpu-loras", "8", "--requests", "60",
                           "--rate", "40", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "cold_adapters.json").read_text())
    cold, resident = result["rows"]["cold"], result["rows"]["resident"]
    assert cold["completed"] == resident["completed"] == 60
    assert sum(c["requests"] for c in cold["by_class"].values()) == 60 and cold["by_class"]["disk"]["requests"] > 0
    assert resident["by_class"]["gpu"]["requests"] == 60


def test_results_name_a_tree_that_differs_from_its_head_dirty(tmp_path, monkeypatch):
    # A device machine may hold the current files under an older .git HEAD: without LORAZOR_COMMIT the
    # recorded commit says so ("+dirty") instead of naming a commit the tree was not.
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    from common import commit

    monkeypatch.delenv("LORAZOR_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "f.py").write_text("a = 1\n")
    subprocess.run(git + ["add", "f.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit() == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert commit() == f"{head}+dirty"
    monkeypatch.setenv("LORAZOR_COMMIT", "abc1234")
    assert commit() == "abc1234"


def test_step_profile_categories_name_inductors_fused_kernels_inductor():
    # Inductor names a fused kernel after the ops it fuses: `..._linear_lora_mul_silu_...` is a SiLU, not LoRA.
    sys.path[:0] = [str(EXAMPLES.parent / "benchmarks" / "probes"), str(EXAMPLES.parent / "benchmarks")]
    from step_roofline import kernel_breakdown

    def kernel(name, us):
        return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=0.0, end=us))

    kernels = [kernel("triton_poi_fused_linear_lora_mul_silu_slice_view_5", 300.0),
               kernel("_lora_expand_kernel", 50.0), kernel("triton_poi_fused_add_cat_paged_attention_slice_3", 30.0),
               kernel("_paged_attention_kernel", 70.0), kernel("nvjet_sm90_tst_128x8_64x12_2x1_v_badd_TNT", 500.0)]
    categories = kernel_breakdown(kernels, steps=1)["category_ms"]
    assert categories == {"fused (inductor)": 0.33, "lora": 0.05, "attention": 0.07, "gemm": 0.5}
