"""GPU-only: the engine's CUDA-graph decode steps equal eager steps while requests join and leave,
and nothing is recaptured after warm-up."""

import copy
import logging
import re

import pytest
import torch
from helpers import EOS, PAD, peft_names
from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
from lorazor.tiny import DEFAULT_ADAPTERS, tiny_peft_model

pytestmark = pytest.mark.gpu
GEN = dict(pad_token_id=PAD, eos_token_id=EOS)
ADAPTERS = ["math", "sql", None, "med", "math", "sql", "med", None, "math", "sql", "med"]


def engines(dtype, grid="exact", compile=False, eager_compile=False):
    base = tiny_peft_model("llama", DEFAULT_ADAPTERS, dtype=dtype).cuda()
    oracle = copy.deepcopy(base)
    eager_config = LoRazorConfig(grid=grid, cuda_graphs=False, compile=eager_compile)
    eager = LoRazorModel.from_peft(copy.deepcopy(base), eager_config)
    graph = LoRazorModel.from_peft(base, LoRazorConfig(grid=grid, cuda_graphs=True, compile=compile))
    kw = dict(max_num_seqs=16, max_num_batched_tokens=48, num_kv_blocks=96, block_size=16)
    return LoRazorEngine(eager, **kw), LoRazorEngine(graph, **kw), oracle


def trace(seed, n=len(ADAPTERS)):
    """Requests of varied prompt and output lengths, adapters, and release settings."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 96, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        release = [None, 2, "never", 0][i % 4]
        out.append(dict(prompt_ids=prompt, adapter=ADAPTERS[i % len(ADAPTERS)], release=release,
                        max_new_tokens=int(torch.randint(4, 20, (1,), generator=g)), **GEN))
    return out


def run_staggered(engine, requests):
    """Add a request every other step: requests join and leave in mid-decode."""
    done, ids = {}, []
    for i, r in enumerate(requests):
        ids.append(engine.add_request(**r))
        if i % 2:
            done.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.mark.parametrize("grid", ["exact", "full"])
def test_graph_replay_equals_eager_as_requests_join_and_leave(grid):
    eager, graph, _ = engines(torch.bfloat16, grid)
    assert graph.graphs is not None and eager.graphs is None
    requests = trace(seed=1)
    a, b = run_staggered(eager, requests), run_staggered(graph, requests)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.release_step == y.release_step
    assert graph.graphs.num_captures > 0
    assert graph.pool.num_free == graph.pool.num_blocks


def test_no_recapture_after_warm_up(caplog):
    eager, graph, _ = engines(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="lorazor.engine"):
        captured = graph.warm_up()
    # The startup log says how many graphs and how long (eager: no word of compiling).
    assert re.search(rf"warm-up: captured {captured} step graphs in [0-9.]+ s .*eager", caplog.text), caplog.text
    assert "compiling" not in caplog.text
    # Decode buckets 2, 4, 8, 16 (one row pads to two) and one token bucket of packed steps, each with
    # LoRA (one adapter class for 3 slots) and backbone only.
    assert captured == graph.graphs.num_graphs() == 5 * (len(graph.model.context.slot_bound_classes()) + 1)
    for seed in (2, 3):
        requests = trace(seed=seed, n=16)
        assert [o.token_ids for o in run_staggered(graph, requests)] == \
            [o.token_ids for o in run_staggered(eager, requests)]
    assert graph.graphs.num_captures == captured, "a new request mix recaptured a graph"


def test_compiled_engine_steps_equal_eager_and_peft(caplog):
    # torch.compile inside the captured step graphs, one compile for every bucket: bf16
    # replays equal the same compiled step run eagerly as requests join and leave; fp32 equals PEFT.
    from torch._dynamo.utils import counters

    eager, graph, _ = engines(torch.bfloat16, compile=True, eager_compile=True)
    pad_packed_steps(eager)
    traces = [trace(seed=seed, n=16) for seed in (5, 6)]
    expected = [[(o.token_ids, o.release_step) for o in run_staggered(eager, t)] for t in traces]
    torch._dynamo.reset()  # count the graphed engine's compiles alone (compiled code is shared by code object)
    counters.clear()
    with caplog.at_level(logging.INFO, logger="lorazor.engine"):
        graph.warm_up()
    # The log says it compiles before the wait (a cold start takes minutes), then how long it took.
    assert re.search(r"compiling the step graphs.*\n(.*warm-up: .* captured \(.*\n)+.*warm-up: captured \d+ step "
                     r"graphs in [0-9.]+ s .*compiled", caplog.text), caplog.text
    compiled = counters["stats"]["unique_graphs"]
    # Decode and packed steps, each with LoRA and backbone only, compile three regions (decoder layer,
    # final norm, rotary embedding) a few times each, about 16 in all; one per bucket would be 48 or more.
    assert 4 <= compiled <= 20, compiled
    for requests, want in zip(traces, expected):
        assert [(o.token_ids, o.release_step) for o in run_staggered(graph, requests)] == want
    assert counters["stats"]["unique_graphs"] == compiled
    assert dict(counters["graph_break"]) == {}
    check_fp32_engine_equals_peft(compile=True)


def pad_packed_steps(engine):
    """Run an engine without graphs through the graphed engine's padded packed step, uncaptured (the
    packed step compiles only there, where token counts are padded); decode-only steps stay eager."""
    from lorazor.runner.paged_graphs import PackedStepGraphs

    class PaddedPacked:
        grid = engine.model.context.grid
        packed = PackedStepGraphs(engine.model.runner, engine.cache, engine.scheduler.max_num_batched_tokens,
                                  engine.scheduler.max_num_seqs, capture=False)

        def serves(self, batch):
            return False

    engine.steps.graphs = PaddedPacked()


def test_fp32_engine_with_graphs_equals_peft():
    check_fp32_engine_equals_peft(compile=False)


def check_fp32_engine_equals_peft(compile):
    _, graph, oracle = engines(torch.float32, compile=compile)
    requests = [dict(r, release="never") for r in trace(seed=4, n=8)]
    outs = run_staggered(graph, requests)
    for r, o in zip(requests, outs):
        with torch.no_grad():
            ref = oracle.generate(input_ids=torch.tensor([r["prompt_ids"]], device="cuda"),
                                  adapter_names=peft_names([r["adapter"]]), do_sample=False,
                                  max_new_tokens=r["max_new_tokens"], **GEN)
        assert o.token_ids == ref[0, len(r["prompt_ids"]):].tolist(), r["adapter"]


@pytest.mark.parametrize("compile", [False, True], ids=["eager_graphs", "compiled_graphs"])
def test_async_steps_equal_sync_and_never_wait_for_the_gpu_but_once(compile):
    # Async scheduling with graphs: the same outputs as the step-by-step engine, and once the graphs
    # are captured no step makes the host wait for the GPU except the read-back of its values
    # (torch's sync debug mode raises on .item(), nonzero(), copies from pageable memory, ...).
    _, graph, _ = engines(torch.bfloat16, compile=compile)
    graph.warm_up()
    sampled = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    requests = [dict(r, eos_token_id=None, **(sampled if i % 3 == 1 else {}))
                for i, r in enumerate(trace(seed=7, n=16))]
    graph.async_scheduling = False
    torch.manual_seed(0)
    expected = [(o.token_ids, o.release_step, o.lora_decode_steps) for o in run_staggered(graph, requests)]
    graph.async_scheduling = True
    graph.pool.reset_cache()  # the same schedule as the first run: no prefix-cache hits from it
    torch.manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = run_staggered(graph, requests)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [(o.token_ids, o.release_step, o.lora_decode_steps) for o in outs] == expected
    assert any(o.release_step >= 0 for o in outs) and graph.pool.num_free == graph.pool.num_blocks


@pytest.mark.whole_gpu
def test_compiled_default_engine_starts_on_a_default_size_pool(caplog):
    # The product's defaults on a GPU: compile="auto" (compiled) and a KV pool of 0.9 of the free
    # memory. Inductor's autotuning once saved a copy of every tensor a generated kernel mutates, the
    # whole pool included: out of memory in warm_up(). Runs alone (`-m whole_gpu`): it takes the GPU.
    base = tiny_peft_model("llama", DEFAULT_ADAPTERS, dtype=torch.float32).cuda()
    oracle = copy.deepcopy(base)
    engine = LoRazorEngine(LoRazorModel.from_peft(base))
    assert engine.model.config.compile is True
    assert engine.cache.nbytes > 0.5 * torch.cuda.mem_get_info()[1], engine.cache.nbytes
    with caplog.at_level(logging.INFO, logger="lorazor.engine"):
        assert engine.warm_up(batch_sizes=[1, 4]) > 0
    assert re.search(r"warm-up: captured \d+ step graphs in [0-9.]+ s .*compiled", caplog.text), caplog.text
    requests = [dict(r, release="never") for r in trace(seed=7, n=6)]
    for r, o in zip(requests, run_staggered(engine, requests)):
        with torch.no_grad():
            ref = oracle.generate(input_ids=torch.tensor([r["prompt_ids"]], device="cuda"),
                                  adapter_names=peft_names([r["adapter"]]), do_sample=False,
                                  max_new_tokens=r["max_new_tokens"], **GEN)
        assert o.token_ids == ref[0, len(r["prompt_ids"]):].tolist(), r["adapter"]
