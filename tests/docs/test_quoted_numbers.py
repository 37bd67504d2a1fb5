"""Numbers the docs quote come from one results file each, and every page that quotes one gives the
file's value: the headline decode table (`e2e_targets_ee7bab4/llama_quick/`), the engine benchmark
(`engine/rows_exact.jsonl`), the calibration time (`calibration_h200/`), the one-runner A/B
(`runner_ab_h200/`), the compiled engine's steps (`step_roofline_h200/`), and the tables of
performance.md, gridtrim.md and testbed.md, cell by cell."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RUN = RESULTS / "e2e_targets_ee7bab4" / "llama_quick" / "e2e_llama-3.2-3b_exact.json"


def page(name: str) -> str:
    return (ROOT / name).read_text()


def read(path: Path) -> str:
    """A result file's text. A folder whose raw results were merged keeps them in `data.json` (file
    name -> content) and `rows.jsonl` (each row with its `source` file): the file is rebuilt from there."""
    if path.exists():
        return path.read_text()
    merged = path.parent / ("rows.jsonl" if path.suffix == ".jsonl" else "data.json")
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in merged.read_text().splitlines()]
        return "".join(json.dumps({k: v for k, v in r.items() if k != "source"}) + "\n" for r in rows
                       if r["source"] == path.name)
    return json.dumps(json.loads(merged.read_text())[path.name])


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


def test_engine_numbers_equal_the_engine_benchmark():
    rows = [json.loads(line) for line in read(RESULTS / "engine" / "rows_exact.jsonl").splitlines()]
    offline = {r["system"]: r for r in rows if r["stage"] in ("offline", "backbone")}
    lorazor, backbone = offline["lorazor"]["req_s"], offline["backbone"]["req_s"]
    for name in ("README.md", "docs/engine.md", "docs/performance.md"):
        assert f"{lorazor:.1f}" in page(name), name
    assert f"108.6 req/s (backbone alone: {backbone:.1f};" in page("README.md")
    assert f"{lorazor / backbone:.2f}x the backbone-only engine" in page("docs/engine.md")
    assert f"| backbone only (the ceiling) | {backbone:.1f} |" in page("docs/performance.md")


def test_this_rounds_numbers_equal_their_results():
    calibration = json.loads(read(RESULTS / "calibration_h200" / "calibration_h200.json"))
    seconds = calibration["profiled"]["seconds"]
    assert f"takes {round(seconds)} s" in page("docs/performance.md")
    assert f"take {round(seconds)} s" in page("CHANGELOG.md")
    drops = [r["drop_points"] for r in calibration["science_learned"]]
    table = page("benchmarks/results/calibration_h200/README.md")
    for r in calibration["science_learned"]:
        accuracy, skip = 100 * r["test_accuracy"], 100 * r["test_skip"]
        row = f"| {r['seed']} | {accuracy:.1f}% | {r['drop_points']:.2f} | {skip:.0f}% |"
        assert row in table, row
    assert f"mean {sum(drops) / len(drops):.2f}" in table
    ab = RESULTS / "runner_ab_h200"
    old, new = (json.loads(read(ab / f"e2e_{tag}.json"))["rows"] for tag in ("old_bbb9a20", "new_54806af"))
    step = lambda rows: next(r["step_ms"] for r in rows if r["L"] == 128)  # noqa: E731
    engine_old, engine_new = (json.loads(read(ab / f"engine_decode_step_{tag}.json"))["step_ms_median"]
                              for tag in ("old_bbb9a20", "new_54806af"))
    readme = page("benchmarks/results/runner_ab_h200/README.md")
    assert f"| {step(old):.3f} ms | {step(new):.3f} ms | {step(new) / step(old):.3f} |" in readme
    assert f"| {engine_old:.3f} ms | {engine_new:.3f} ms | {engine_new / engine_old:.3f} |" in readme


def test_compiled_engine_numbers_equal_the_roofline_run():
    folder = RESULTS / "step_roofline_h200"
    runs = {tag: json.loads(read(folder / f"step_roofline_{tag}_47fbe2b.json"))
            for tag in ("eager", "compiled")}
    step = {tag: {(r["batch"], r["kind"]): r for r in rows if r["phase"] == "decode"} for tag, rows in runs.items()}
    warm = next(r for r in runs["compiled"] if r["phase"] == "warmup")
    engine, table = page("docs/engine.md"), page("benchmarks/results/step_roofline_h200/README.md")
    for kind in ("backbone", "lora"):
        compiled, eager = step["compiled"][(256, kind)], step["eager"][(256, kind)]
        assert f"{compiled['step_ms']:.3f} ms compiled" in engine or f"{compiled['step_ms']:.3f} ms against" in engine
        assert f"{eager['step_ms']:.3f} ms" in engine
        assert f"| {eager['step_ms']:.3f} / {eager['vs_floor']:.2f}x | {compiled['step_ms']:.3f} / " \
               f"{compiled['vs_floor']:.2f}x |" in table
    assert f"{step['compiled'][(256, 'backbone')]['kernels_per_step']} kernels against " \
           f"{step['eager'][(256, 'backbone')]['kernels_per_step']:,}" in engine
    assert f"took {warm['seconds']} s" in engine and f"{warm['graphs']} / {warm['seconds']} s" in table


def test_async_scheduling_numbers_equal_their_run():
    rows = json.loads(read(RESULTS / "step_roofline_h200" / "step_roofline_async_compiled_0141323.json"))
    step = {(r["kind"], r["scheduling"]): r for r in rows if r["phase"] == "decode" and r["batch"] == 256}
    engine, changelog = page("docs/engine.md"), page("CHANGELOG.md")
    backbone, lora = step[("backbone", "async")], step[("lora", "async")]
    sync_backbone = step[("backbone", "sync")]["step_ms"]
    assert f"{backbone['step_ms']:.3f} ms with\nasync scheduling against {sync_backbone:.3f} ms" in engine
    assert f"{lora['step_ms']:.3f} ms against\n{step[('lora', 'sync')]['step_ms']:.3f} ms with 128 adapters" in engine
    assert f"busy {backbone['gpu_busy_ms']:.3f} ms" in engine
    assert f"{step[('backbone', 'sync')]['step_ms']:.3f} -> {backbone['step_ms']:.3f} ms" in changelog
    assert f"{step[('lora', 'sync')]['step_ms']:.3f} -> {lora['step_ms']:.3f} ms" in changelog


def rows_of(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in read(path).splitlines()]
    return json.loads(read(path))["rows"]


def table_row(text: str, label: str) -> list[str]:
    """The cells after the first cell of the table row whose first cell is `label`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no table row {label!r}")


def test_performance_grid_tables_equal_their_results():
    # docs/performance.md: decode tok/s of every grid mode over L, per model, and the L = 1 / 128
    # ratios to the backbone, from the sweeps' JSON.
    performance = page("docs/performance.md")
    text = {"llama-3.2-3b": performance.split("### Every grid mode")[1].split("Mistral-7B shape")[0],
            "mistral-7b": performance.split("### Every grid mode")[1].split("Mistral-7B shape")[1]}
    for model, name in (("llama-3.2-3b", "e2e_llama-3.2-3b.json"), ("mistral-7b", "e2e_mistral-7b_grids.json")):
        rows = [r for r in rows_of(RESULTS / name) if r["system"] == "lorazor"]
        for grid in ("full", "active_rows", "two_class", "exact"):
            cells = table_row(text[model], f"LoRazor `{grid}`")
            by_l = {r["L"]: r for r in rows if r["grid"] == grid}
            for cell, L in zip(cells, (1, 4, 8, 16, 32, 64, 128)):
                r = by_l[L]
                want = f"{round(r['decode_tok_s'])}"
                if L in (1, 128):
                    want += f" ({r['vs_backbone']:.2f})"
                assert cell == want, (model, grid, L, cell, want)


def test_performance_release_and_engine_tables_equal_their_results():
    performance = page("docs/performance.md")
    graphs, compiled = (rows_of(RESULTS / f"release_throughput{tag}.json") for tag in ("", "_compiled"))
    labels = {"backbone only": "backbone only", "no release": "no release",
              "profiled k=63": "`ProfiledRelease`, k = 63 for every adapter",
              "profiled k=0": "`ProfiledRelease`, k = 0 (prefill only)"}
    for a, b in zip(graphs, compiled):
        cells = table_row(performance, labels[a["policy"]])
        fmt = lambda r: f"{round(r['decode_tok_s'])}" + ("" if r["adapters"] == 0 else f" ({r['vs_backbone']:.2f})")  # noqa: E731
        assert cells[1:] == [fmt(a), fmt(b)], (a["policy"], cells)
    engine = {r["system"]: r for r in rows_of(RESULTS / "engine" / "rows_exact.jsonl")
              if r["stage"] in ("offline", "backbone", "static")}
    engine.update({r["system"]: r for r in rows_of(RESULTS / "engine" / "rows_full.jsonl")
                   if r["stage"] == "offline" and r["L"] == 128})
    for system, label in (("backbone", "backbone only (the ceiling)"), ("lorazor", "LoRazor: `exact` grid + StepTrim"),
                          ("exact", "`exact` grid, no release (GridTrim only)"),
                          ("full_release", "`full` grid + StepTrim"),
                          ("full", "`full` grid, no release (the vLLM-style grid)"),
                          ("static", "static `generate()`, batches of 256 (`exact` + StepTrim)")):
        r = engine[system]
        assert table_row(performance, label) == [f"{r['req_s']:.1f}", f"{r['out_tok_s']:,.0f}"], system


def test_testbed_tables_are_the_paper_runs_own():
    # docs/testbed.md quotes Tables 1 and 4 as `python -m lorazor.testbed.paper` wrote them.
    generated = set(page("benchmarks/results/testbed_paper/paper_tables.md").splitlines())
    rows = [line for line in page("docs/testbed.md").splitlines()
            if re.match(r"\| (math|sql|medqa|science) \| \d", line)]
    assert len(rows) == 8
    for row in rows:
        assert row in generated, row


def test_gridtrim_kernel_table_equals_the_kernel_benchmark():
    rows = {(r["model"], r["case"], r["L"]): r for r in rows_of(RESULTS / "kernels.json")}
    gridtrim = page("docs/gridtrim.md")
    columns = ("full_us", "active_rows_us", "two_class_us", "exact_us", "full_merged_us", "exact_merged_us", "floor_us")
    labels = {"Llama-3.2-3B": "llama-3.2-3b", "Mistral-7B": "mistral-7b"}
    checked = 0
    for line in gridtrim.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] not in labels:
            continue
        L = int(cells[1].split(",")[0])
        r = rows[(labels[cells[0]], "decode" if cells[1] == str(L) else "mixed", L)]
        want = [f"{r[c]:.1f}" for c in columns]
        want[5] = f"**{want[5]}**"
        want.append(f"{r['exact_merged_bank128_us']:.1f} / {r['exact_merged_bank128_unbounded_us']:.1f}")
        assert cells[2:] == want, line
        checked += 1
    assert checked == 8
    llama, mistral = rows[("llama-3.2-3b", "decode", 128)], rows[("mistral-7b", "decode", 128)]
    assert f"**{llama['exact_merged_us'] / llama['full_us']:.2f}x the time of `full`**" in gridtrim
    assert f"**{llama['merged_over_floor']:.2f}x the memory floor** on Llama and " \
           f"**{mistral['merged_over_floor']:.2f}x** on Mistral" in gridtrim
    share = llama["exact_merged_us"] / llama["full_us"]
    assert f"`exact` takes {share:.2f}x the\ntime of `full` at 128 adapters and " \
           f"{llama['merged_over_floor']:.2f}x the memory floor" in page("docs/performance.md")


def test_regional_compile_numbers_equal_their_runs():
    # The step roofline, warm-up and engine runs of the one-compiled-layer round, as the docs quote them.
    rows = json.loads(read(RESULTS / "step_roofline_h200" / "step_roofline_regional_compiled_bd5e01c.json"))
    decode = {(r["batch"], r["kind"]): r for r in rows if r["phase"] == "decode"}
    prefill = {r["kind"]: r for r in rows if r["phase"] == "prefill"}
    drift = next(r for r in rows if r["phase"] == "drift")
    table, engine = page("benchmarks/results/step_roofline_h200/README.md"), page("docs/engine.md")
    for (batch, kind), r in decode.items():
        gap = 100 * (1 - r["gpu_busy_ms"] / r["step_ms"])
        assert (f"| {batch} | {kind} | {r['step_ms']:.3f} / {r['vs_floor']:.2f}x | {r['vs_roofline']:.2f}x | "
                f"{r['gpu_busy_ms']:.3f} | {gap:.1f}% | {r['kernels_per_step']} |") in table, (batch, kind)
    backbone = decode[(256, "backbone")]
    assert f"{backbone['step_ms']:.3f} ms for\nthe backbone at batch 256" in engine
    assert f"takes {prefill['backbone']['step_ms']:.3f} ms, {prefill['backbone']['vs_floor']:.2f}x its" in engine
    assert f"**{prefill['backbone']['vs_floor']:.2f}x / {prefill['lora']['vs_floor']:.2f}x**" in table
    assert ", ".join(f"{x:.1f}" for x in drift["trace_req_s"]) + " req/s" in table
    warm = {tag: json.loads(read(RESULTS / "warmup_profile_h200" / f"warmup_profile_{tag}_bd5e01c.json"))
            for tag in ("eager", "compiled", "compiled_restart")}
    warm_table = page("benchmarks/results/warmup_profile_h200/README.md")
    for tag in warm:
        seconds = warm[tag]["warm_up_s"]
        assert f"{seconds:.1f} s" in engine and f"{seconds:.1f} s" in warm_table, tag
        assert f"| {warm[tag]['graphs']} | {warm[tag]['packed_step_gpu_ms']:.1f} ms |" in warm_table, tag
    eager_engine = [json.loads(line) for line in
                    read(RESULTS / "engine" / "eager_189be60" / "rows_exact_eager.jsonl").splitlines()]
    offline = {r["system"]: r for r in eager_engine if r["stage"] == "offline"}
    performance = page("docs/performance.md")
    for system in ("lorazor", "exact"):
        assert f"{offline[system]['req_s']:.1f} req/s" in performance, system
    assert f"and {offline['lorazor']['req_s']:.1f} req/s in a rerun with async scheduling" in page("README.md")


def test_seats_and_compile_numbers_equal_their_runs():
    """docs/engine.md, docs/performance.md and the README quote `engine/shapes_h100/` row by row."""
    folder = RESULTS / "engine" / "shapes_h100"

    def req_s(mode, seats, system="lorazor"):
        rows = [json.loads(line) for line in read(folder / f"rows_exact_{mode}_{seats}.jsonl").splitlines()]
        return next(r["req_s"] for r in rows if r["system"] == system)

    engine, performance = page("docs/engine.md"), page("docs/performance.md")
    eager = [req_s("eager", n) for n in (256, 512, 1024)]
    compiled = [req_s("compiled", n) for n in (256, 512, 1024)]
    backbone = [req_s("compiled", n, "backbone") for n in (256, 512, 1024)]
    assert " / ".join(f"{x:.1f}" for x in eager) + " req/s eager" in engine
    assert " / ".join(f"{x:.1f}" for x in compiled) + " req/s compiled" in engine
    for shape, e, c, b in zip(("256 / 2,048", "512 / 4,096 (the default)", "1,024 / 8,192"), eager, compiled, backbone):
        assert f"| {shape} | {e:.1f} | {c:.1f} | {b:.1f} | {c / b:.2f}x |" in performance, shape
    default = f"{eager[1]:.1f} req/s with eager graphs and {compiled[1]:.1f} req/s compiled"
    assert default + f"\n  ({compiled[1] / backbone[1]:.2f}x its backbone)" in page("README.md")
    assert (f"{compiled[1]:.1f} req/s against\n{eager[1]:.1f} req/s with eager graphs at the default 512 seats, "
            f"{compiled[1] / backbone[1]:.2f}x its backbone ({backbone[1]:.1f} req/s)") in engine
    from lorazor.config import EngineConfig

    assert EngineConfig().max_num_seqs == 512


def test_decode_heavy_and_adapter_floor_numbers_equal_their_runs():
    """docs/performance.md quotes `engine/decode_heavy_h100/` and `adapter_bytes_cpu/` row by row."""
    performance = page("docs/performance.md")
    folder = RESULTS / "engine" / "decode_heavy_h100"

    def rows(mode):
        lines = read(folder / f"rows_exact_decode_heavy_{mode}.jsonl").splitlines()
        return [json.loads(line) for line in lines]

    summaries = {}
    for mode in ("eager", "compiled"):
        req = {r["system"]: r["req_s"] for r in rows(mode) if "req_s" in r}
        summary = summaries[mode] = next(r for r in rows(mode) if r["stage"] == "summary")
        assert abs(summary["vs_backbone"] - req["lorazor"] / req["backbone"]) < 1e-4
        assert (f"| {mode} | {req['lorazor']:.1f} | {req['exact']:.1f} | {req['backbone']:.1f} | "
                f"{summary['vs_backbone']:.2f}x | {summary['gap_closed']:.0%} |") in performance, mode
    measured = {"mixed": measured_mixed_ratio(), "decode-heavy": summaries["compiled"]["vs_backbone"]}
    for workload, label in (("mixed", "mixed (4,096 requests)"), ("decode-heavy", "decode-heavy")):
        floors = json.loads(read(RESULTS / "adapter_bytes_cpu" / f"adapter_bytes_{workload}.json"))
        vs = floors["floor_vs_backbone"]
        assert (f"| {label} | {vs['adapter_bytes']['lorazor']:.2f}x | {vs['with_lora_activations']['lorazor']:.2f}x | "
                f"{measured[workload]:.2f}x |") in performance, workload
        assert f"{floors['lora_activation_mb_per_token']:.2f} MB per LoRA token" in performance


def measured_mixed_ratio() -> float:
    """LoRazor / backbone, compiled, at the default 512 seats (`engine/shapes_h100/`)."""
    rows = read(RESULTS / "engine" / "shapes_h100" / "rows_exact_compiled_512.jsonl").splitlines()
    req = {r["system"]: r["req_s"] for r in map(json.loads, rows) if "req_s" in r}
    return req["lorazor"] / req["backbone"]


def test_default_engine_numbers_equal_the_defaults_run():
    runs = json.loads(read(RESULTS / "defaults_h100" / "runs.json"))
    step = {(tag, r["batch"], r["kind"]): r["step_ms"] for tag in ("compiled_cold", "eager")
            for r in runs[tag] if r["phase"] == "decode"}
    prefill = {tag: next(r["step_ms"] for r in runs[tag] if r["phase"] == "prefill" and r["kind"] == "backbone")
               for tag in ("compiled_cold", "eager")}
    cold, restart = (next(r for r in runs[tag] if r["phase"] == "warmup") for tag in ("compiled_cold",
                                                                                    "compiled_restart"))
    engine, deployment, table = page("docs/engine.md"), page("docs/deployment.md"), \
        page("benchmarks/results/defaults_h100/README.md")
    assert (f"{step[('compiled_cold', 256, 'backbone')]:.3f} ms per batch-256 backbone decode step against "
            f"{step[('eager', 256, 'backbone')]:.3f} ms") in engine
    assert f"{step[('compiled_cold', 256, 'lora')]:.3f} ms against\n{step[('eager', 256, 'lora')]:.3f} ms" in engine
    assert f"{prefill['compiled_cold']} ms against {prefill['eager']} ms" in engine
    for text in (engine, deployment):
        assert f"{cold['seconds']} s" in text and f"{restart['seconds']} s" in text
    assert f"| decode, batch 256, backbone | {step[('compiled_cold', 256, 'backbone')]:.2f} ms" in table


def test_fp8_and_adapter_load_numbers_equal_their_runs():
    models = page("docs/models.md")
    data = json.loads((RESULTS / "defaults_h100" / "data.json").read_text())
    for name, shape in (("llama-3.2-3b", "Llama-3.2-3B"), ("mistral-7b", "Mistral-7B")):
        fp8, bf16 = ({(r["batch"], r["kind"]): r["step_ms"] for r in data[f"step_roofline_{name}_{q}_a8dd29f.json"]
                      if r.get("phase") == "decode"} for q in ("fp8", "bf16"))
        ratio = [fp8[key] / bf16[key] for key in ((1, "backbone"), (256, "backbone"), (256, "lora"))]
        assert f"| {shape} | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |" in models
    trace = {tag: {r["system"]: r["req_s"] for r in map(json.loads, read(
        RESULTS / "engine" / "mixed_defaults_h100" / f"rows_exact_{tag}.jsonl").splitlines())}
        for tag in ("defaults_eager", "defaults_compiled", "fp8_trace_fp8")}
    assert f"serves {trace['fp8_trace_fp8']['lorazor'] / trace['defaults_compiled']['lorazor']:.2f}x the requests" \
        in models
    eager, compiled, fp8 = (trace[t] for t in ("defaults_eager", "defaults_compiled", "fp8_trace_fp8"))
    assert (f"served {compiled['lorazor']:.1f} req/s against\n{eager['lorazor']:.1f} req/s with the old eager default, "
            f"{compiled['lorazor'] / eager['lorazor']:.2f}x, and {compiled['lorazor'] / compiled['backbone']:.2f}x its "
            f"compiled backbone ({compiled['backbone']:.1f} req/s)") in page("docs/engine.md")
    assert (f"eager {eager['lorazor']:.1f}, compiled {compiled['lorazor']:.1f}, compiled backbone\n  "
            f"{compiled['backbone']:.1f} req/s ({compiled['lorazor'] / compiled['backbone']:.2f}x); in fp8, compiled "
            f"{fp8['lorazor']:.1f} against a backbone of {fp8['backbone']:.1f} "
            f"({fp8['lorazor'] / fp8['backbone']:.2f}x)") in page("docs/performance.md")
    table = page("benchmarks/results/engine/mixed_defaults_h100/README.md")
    for tag, label in (("defaults_eager", "eager (the old default)"), ("defaults_compiled", "compiled (the default)"),
                       ("fp8_trace_fp8", "compiled, fp8 base weights")):
        lora, backbone = trace[tag]["lorazor"], trace[tag]["backbone"]
        assert f"| {label} | {lora:.1f} | {backbone:.1f} | {lora / backbone:.2f}x |" in table
    load = json.loads(read(RESULTS / "adapters" / "adapter_load_h100_8259ecf.json"))
    floor_ms = load["copy_floor_s"] / load["loads"] * 1e3
    for text in (page("docs/adapters.md"), page("benchmarks/results/adapters/README.md")):
        assert f"{load['per_load_ms']} ms" in text and f"{load['vs_floor']}x" in text and f"{floor_ms:.3f} ms" in text


def test_moe_numbers_equal_the_moe_run():
    # The run's rows are the JSON lines of the results README's block.
    readme = page("benchmarks/results/moe_h100/README.md")
    rows = [json.loads(line) for line in readme.split("```")[1].strip().splitlines()]
    one, full = ({r["batch"]: r for r in rows if r["phase"] == "decode"}[b] for b in (1, 256))
    prefill = next(r for r in rows if r["phase"] == "prefill")
    models = page("docs/models.md").replace("\n", " ")
    assert (f"a batch-1 decode step takes {one['backbone_vs_floor']}x the bytes it reads (backbone) and "
            f"{one['lora_vs_backbone']}x that with an adapter") in models
    assert (f"the backbone step takes {full['backbone_vs_floor']}x its bytes and 64 adapters make it "
            f"{full['lora_vs_backbone']}x slower (their expert slices add "
            f"{full['lora_floor_ms'] / full['backbone_floor_ms'] - 1:.0%} to the bytes)") in models
    assert f"a 4,096-token prefill takes {prefill['vs_floor']}x its FLOPs floor" in models
    assert (f"| decode, batch 1, backbone | {one['backbone_ms']} ms | {one['backbone_floor_ms']} ms (bytes) | "
            f"{one['backbone_vs_floor']}x |") in readme
    assert f"| {full['lora_ms']} ms | {full['lora_floor_ms']} ms | {full['lora_vs_floor']}x; **" in readme
    ab = json.loads((RESULTS / "moe_h100" / "moe_ab_d3c5083.json").read_text())["rows"]
    now = next(r for r in ab if r["phase"] == "decode" and r["batch"] == 256)
    assert (f"the current code's batch-256 backbone step takes {now['backbone_vs_floor']}x its bytes and 64 adapters "
            f"make it {now['lora_vs_backbone']}x slower") in models
    assert f"| {now['backbone_ms']:.3f} ms ({now['backbone_vs_floor']}x;" in readme


def test_h100_kernel_config_numbers_equal_their_runs():
    data = json.loads((RESULTS / "defaults_h100" / "data.json").read_text())

    def step(name, batch, kind):
        return next(r["step_ms"] for r in data[name] if r.get("phase") == "decode" and (r["batch"], r["kind"]) ==
                    (batch, kind))

    default, h200 = "step_roofline_cfg_default_d3c5083.json", "step_roofline_cfg_NVIDIA_H200_d3c5083.json"
    split, fused = "step_roofline_cfg_default_b16_d3c5083.json", "step_roofline_cfg_h200_fused16_d3c5083.json"
    gridtrim = page("docs/gridtrim.md").replace("\n", " ")
    assert f"from {step(default, 256, 'lora'):.2f} to {step(h200, 256, 'lora'):.2f} ms" in gridtrim
    assert f"{step(fused, 1, 'lora'):.2f} ms against {step(split, 1, 'lora'):.2f} ms split" in gridtrim
    assert f"to {step(h200, 256, 'lora'):.3f} ms\nagainst {step(default, 256, 'lora'):.3f} ms" in page("docs/engine.md")
    readme = page("benchmarks/results/defaults_h100/README.md")
    for name, batch, kind in ((default, 256, "lora"), (h200, 256, "lora"), (h200, 1, "lora"), (fused, 1, "lora")):
        assert f"{step(name, batch, kind):.3f} ms" in readme, (name, batch, kind)


def test_h100_kernel_config_trace_equals_its_run():
    rows = [json.loads(line) for line in read(RESULTS / "engine" / "mixed_defaults_h100" /
                                              "rows_exact_h100_config_f5d2d48.jsonl").splitlines()]
    lorazor, backbone = (next(r["req_s"] for r in rows if r["system"] == s) for s in ("lorazor", "backbone"))
    assert (f"with the H100's own kernel file, {lorazor:.1f} req/s against {backbone:.1f}, "
            f"{lorazor / backbone:.2f}x") in page("docs/engine.md").replace("\n", " ")
    assert f"| compiled, the H100's file | {lorazor:.1f} | {backbone:.1f} | **{lorazor / backbone:.2f}x**" in page(
        "benchmarks/results/engine/mixed_defaults_h100/README.md")



def test_h100_a8dd29f_tables_equal_their_runs():
    # The one-launch GEMM + LoRA A/B and the bf16 / fp8 rows of both shapes (defaults_h100/README.md).
    data = json.loads((RESULTS / "defaults_h100" / "data.json").read_text())
    readme = page("benchmarks/results/defaults_h100/README.md")

    def steps(name):
        return {(r["batch"], r["kind"]): r["step_ms"] for r in data[name] if r.get("phase") == "decode"}

    for cfg in ("default", "gemv_lora16", "gemv16"):
        for ms in steps(f"step_roofline_cfg_{cfg}_a8dd29f.json").values():
            assert f"{ms:.3f} ms" in readme, (cfg, ms)
    for model in ("llama-3.2-3b", "mistral-7b"):
        bf16, fp8 = (steps(f"step_roofline_{model}_{q}_a8dd29f.json") for q in ("bf16", "fp8"))
        for key in bf16:
            assert f"{bf16[key]:.3f} ms" in readme and f"{fp8[key]:.3f} ms" in readme, (model, key)
            assert f"{fp8[key] / bf16[key]:.2f}" in readme, (model, key)
    sweep = data["kernels_sweep_a8dd29f.json"]["sweep"]
    assert f"at {sweep[0]['us']} us" in readme and f"at {min(r['us'] for r in sweep)} us" in readme
