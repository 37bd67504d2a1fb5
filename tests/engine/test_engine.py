"""LoRazorEngine: continuous batching equals PEFT (and LoRazor's static generate for StepTrim) per request."""

import asyncio

import pytest
import torch
from helpers import EOS, PAD, build_pair, peft_names
from lorazor import AdapterError, LoRazorConfig, LoRazorEngine, ProfiledRelease

GEN = dict(pad_token_id=PAD, eos_token_id=EOS)


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", LoRazorConfig(cuda_graphs=False))


def prompts(n, seed=0, base=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (base + 3 * i % 11,), generator=g).tolist() for i in range(n)]


def peft_tokens(oracle, prompt, adapter, max_new_tokens, **kw):
    with torch.no_grad():
        out = oracle.generate(input_ids=torch.tensor([prompt]), adapter_names=peft_names([adapter]), do_sample=False,
                              max_new_tokens=max_new_tokens, **GEN, **kw)
    return out[0, len(prompt):].tolist()


def engine(model, **kw):
    return LoRazorEngine(model, **{"max_num_seqs": 8, "max_num_batched_tokens": 32, "num_kv_blocks": 64,
                                   "block_size": 4, **kw})


ADAPTERS = ["math", "sql", None, "med", "math", "sql", None, "med", "math"]


def test_staggered_arrivals_equal_peft(pair):
    model, oracle = pair
    eng = engine(model)
    ps = prompts(len(ADAPTERS))
    done, ids = {}, []
    for i, (p, a) in enumerate(zip(ps, ADAPTERS)):
        ids.append(eng.add_request(p, adapter=a, max_new_tokens=5 + i % 4, **GEN))
        for out in eng.step():  # requests join while others decode
            if out.finished:
                done[out.request_id] = out
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for i, (p, a) in enumerate(zip(ps, ADAPTERS)):
        assert done[ids[i]].token_ids == peft_tokens(oracle, p, a, 5 + i % 4), f"request {i} ({a})"
        assert done[ids[i]].finish_reason in ("length", "eos")
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("budget", [3, 7, 64], ids=["chunks_of_3", "chunks_of_7", "unchunked"])
def test_chunked_prefill_equals_unchunked(pair, budget):
    model, oracle = pair
    ps = prompts(4, seed=2, base=9)
    outs = engine(model, max_num_batched_tokens=budget).generate(
        [dict(prompt_ids=p, adapter=a, max_new_tokens=6, **GEN) for p, a in zip(ps, ADAPTERS)])
    assert [o.token_ids for o in outs] == [peft_tokens(oracle, p, a, 6) for p, a in zip(ps, ADAPTERS)]


def test_preemption_and_recompute_give_the_same_tokens(pair):
    model, oracle = pair
    ps = prompts(6, seed=3)
    eng = engine(model, num_kv_blocks=7, max_num_batched_tokens=16)
    ids = [eng.add_request(p, adapter=a, max_new_tokens=10, **GEN) for p, a in zip(ps, ADAPTERS)]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
        # Block-table rows belong to running requests only: a preempted request gives its row back.
        held = [r for r in eng.requests.values() if r.table_row is not None]
        assert {id(r) for r in held} <= {id(r) for r in eng.scheduler.running}
        assert len(eng.table_rows._free) + len(held) == eng.scheduler.max_num_seqs
    assert eng.scheduler.num_preemptions > 0
    assert [done[i].token_ids for i in ids] == [peft_tokens(oracle, p, a, 10) for p, a in zip(ps, ADAPTERS)]
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("release", [0, 2, "never"])
def test_release_settings_equal_static_generate(pair, release):
    model, _ = pair
    ps = prompts(4, seed=4)
    eng = engine(model, num_kv_blocks=9, max_num_batched_tokens=8)  # preemptions replay the decisions
    outs = eng.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=7, release=release, **GEN)
                         for p, a in zip(ps, ADAPTERS)])
    for p, a, o in zip(ps, ADAPTERS, outs):
        ref = model.generate(
            torch.tensor([p], device=model.device),
            adapter_ids=[a],
            release=[release],
            max_new_tokens=7,
            do_sample=False,
            **GEN,
        )
        assert o.token_ids == ref.sequences[0, len(p):].tolist()
        assert o.release_step == int(ref.release_steps[0])
        assert (o.decode_steps, o.lora_decode_steps) == (int(ref.decode_steps[0]), int(ref.lora_decode_steps[0]))


def test_default_profiled_policy_applies(pair):
    model, _ = pair
    model.release_policy = ProfiledRelease({"math": 1})
    model.config = model.config.__class__(**{**model.config.to_dict(), "release": "profiled"})
    try:
        out = engine(model).generate([dict(prompt_ids=prompts(1)[0], adapter="math", max_new_tokens=6, **GEN)])[0]
    finally:
        model.release_policy = None
        model.config = model.config.__class__(**{**model.config.to_dict(), "release": "none"})
    assert out.release_step == 1 and out.lora_decode_steps == 1


def test_output_does_not_depend_on_the_batch(pair):
    model, _ = pair
    p = prompts(1, seed=5)[0]
    alone = engine(model).generate([dict(prompt_ids=p, adapter="sql", max_new_tokens=8, **GEN)])[0].token_ids
    mixed = engine(model).generate([dict(prompt_ids=q, adapter=a, max_new_tokens=8, **GEN)
                                    for q, a in zip(prompts(5, seed=6) + [p], ADAPTERS[:5] + ["sql"])])
    assert mixed[-1].token_ids == alone


def test_abort_frees_blocks_and_a_random_trace_never_leaks(pair):
    model, oracle = pair
    eng = engine(model, num_kv_blocks=16)
    g = torch.Generator().manual_seed(7)
    kept = {}
    for i, p in enumerate(prompts(12, seed=7)):
        rid = eng.add_request(p, adapter=ADAPTERS[i % len(ADAPTERS)], max_new_tokens=4 + i % 5, **GEN)
        kept[rid] = (p, ADAPTERS[i % len(ADAPTERS)], 4 + i % 5)
        eng.step()
        if torch.rand(1, generator=g).item() < 0.3 and eng.requests:
            victim = next(iter(eng.requests))
            assert eng.abort(victim).finish_reason == "abort"
            kept.pop(victim)
    finished = {}
    while eng.has_unfinished():
        finished.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.scheduler.running and not eng.scheduler.waiting
    assert len(eng.table_rows._free) == eng.scheduler.max_num_seqs  # every block-table row came back
    for rid, out in finished.items():
        if rid in kept:
            p, a, n = kept[rid]
            assert out.token_ids == peft_tokens(oracle, p, a, n)


def test_more_adapters_than_slots_wait_their_turn(tmp_path):
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False, max_loras=2))
    ps = prompts(5, seed=8)
    rows = ["math", "sql", "med", "math", "med"]
    outs = engine(model).generate([dict(prompt_ids=p, adapter=a, max_new_tokens=5, **GEN) for p, a in zip(ps, rows)])
    assert [o.token_ids for o in outs] == [peft_tokens(oracle, p, a, 5) for p, a in zip(ps, rows)]


def test_a_request_waiting_for_a_slot_does_not_block_the_others():
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False, max_loras=2))
    eng = engine(model)
    ps = prompts(4, seed=18)
    first = [eng.add_request(ps[0], adapter="math", max_new_tokens=8, **GEN),
             eng.add_request(ps[1], adapter="sql", max_new_tokens=8, **GEN)]
    eng.step()  # math and sql take both slots
    blocked = eng.add_request(ps[2], adapter="med", max_new_tokens=3, **GEN)
    later = eng.add_request(ps[3], adapter="math", max_new_tokens=3, **GEN)
    eng.step()
    running = {r.request_id for r in eng.scheduler.running}
    assert later in running and blocked not in running  # math's request passes med's, which waits
    assert eng.scheduler.waiting[0].request_id == blocked
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for rid, p, a, n in zip(first + [blocked, later], ps, ["math", "sql", "med", "math"], [8, 8, 3, 3]):
        assert done[rid].token_ids == peft_tokens(oracle, p, a, n)


def test_a_released_request_gives_its_slot_to_a_waiting_adapter():
    # StepTrim releases an adapter for good: once both slots' requests have released theirs, a third
    # adapter's request runs beside them (before: it waited for one of them to finish), and every
    # request's tokens still equal LoRazor's static generate with the same release.
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False, max_loras=2))
    eng = engine(model)
    ps = prompts(3, seed=21)
    first = [eng.add_request(ps[0], adapter="math", max_new_tokens=10, release=1, **GEN),
             eng.add_request(ps[1], adapter="sql", max_new_tokens=10, release=1, **GEN)]
    done = {}
    for _ in range(4):  # prefill, then the decode forwards that release both
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert all(eng.requests[r].release_step == 1 for r in first)
    third = eng.add_request(ps[2], adapter="med", max_new_tokens=3, **GEN)
    done.update({o.request_id: o for o in eng.step() if o.finished})
    running = {r.request_id for r in eng.scheduler.running}
    assert third in running and set(first) <= running, running
    assert model.adapters["med"].location == "gpu"
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for rid, p, a in zip(first, ps, ["math", "sql"]):
        ref = model.generate(torch.tensor([p], device=model.device), adapter_ids=[a], max_new_tokens=10, release=[1],
                             **GEN)
        assert done[rid].token_ids == ref.sequences[0, len(p):].tolist() and done[rid].release_step == 1
    assert done[third].token_ids == peft_tokens(oracle, ps[2], "med", 3)


def test_waiting_requests_adapters_are_loaded_ahead():
    # One running request at a time and 2 slots for 3 adapters: while a resident adapter's request
    # runs, the waiting request's adapter is loaded into the idle slot, before its first step.
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False, max_loras=2))
    resident = [n for n in model.adapter_names if model.adapters[n].location == "gpu"]
    away = [n for n in model.adapter_names if model.adapters[n].location != "gpu"]
    assert len(resident) == 2 and len(away) == 1
    eng = engine(model, max_num_seqs=1)
    ps = prompts(2, seed=19)
    ids = [eng.add_request(ps[0], adapter=resident[0], max_new_tokens=6, **GEN),
           eng.add_request(ps[1], adapter=away[0], max_new_tokens=4, **GEN)]
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == [ids[1]]
    assert model.adapters[away[0]].location == "gpu" and model.adapters[resident[0]].location == "gpu"
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[ids[0]].token_ids == peft_tokens(oracle, ps[0], resident[0], 6)
    assert done[ids[1]].token_ids == peft_tokens(oracle, ps[1], away[0], 4)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(adapter="physics"), KeyError, "unknown adapter 'physics'"),
    (dict(prompt_ids=[]), ValueError, "empty prompt"),
    (dict(prompt_ids=[5] * 300), ValueError, "exceeds the KV pool"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0, got -1"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(prompt_ids=[5, 500]), ValueError, "token id 500, outside the vocabulary"),
    (dict(prompt_ids=[5, -2, 700]), ValueError, "token id -2, outside the vocabulary"),
    (dict(prompt_ids=[5, True]), TypeError, "prompt_ids must be a list of token ids"),
    (dict(prompt_ids=[5, 6.0]), TypeError, "prompt_ids must be a list of token ids"),
    (dict(release="soon"), ValueError, r"release must be None, 'never' or an int in \[0, 2147483647\], got 'soon'"),
    (dict(num_return_sequences=2, do_sample=True), ValueError, "num_return_sequences=2"),
    (dict(request_id="dup"), ValueError, "request_id 'dup' is already in use"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(pair, kwargs, error, message):
    model, oracle = pair
    eng = engine(model, num_kv_blocks=16)
    p = prompts(1, seed=9)[0]
    eng.add_request(p, adapter="med", max_new_tokens=5, request_id="dup", **GEN)
    with pytest.raises(error, match=message):
        eng.add_request(**{"prompt_ids": [4, 5, 6], "max_new_tokens": 3, **GEN, **kwargs})
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(outs) == ["dup"] and outs["dup"].token_ids == peft_tokens(oracle, p, "med", 5)


def test_a_bad_request_in_an_offline_batch_leaves_nothing_queued(pair):
    model, oracle = pair
    eng = engine(model, num_kv_blocks=16)
    p = prompts(1, seed=9)[0]
    earlier = eng.add_request(p, adapter="med", max_new_tokens=4, **GEN)  # queued before: it keeps running
    batch = [dict(prompt_ids=p, adapter="math", max_new_tokens=3, **GEN),
             dict(prompt_ids=p, adapter="sql", max_new_tokens=3, **GEN),
             dict(prompt_ids=p, adapter="physics", max_new_tokens=3, **GEN)]
    with pytest.raises(KeyError, match="unknown adapter 'physics'"):
        eng.generate(batch)
    assert list(eng.requests) == [earlier] and len(eng.scheduler.waiting) == 1
    assert model.registry.in_use["math"] == model.registry.in_use["sql"] == 0
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(outs) == [earlier] and outs[earlier].token_ids == peft_tokens(oracle, p, "med", 4)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_adapter_in_use_cannot_be_unregistered(pair):
    model, _ = pair
    eng = engine(model)
    rid = eng.add_request(prompts(1)[0], adapter="sql", max_new_tokens=3, **GEN)
    with pytest.raises(AdapterError, match="adapter 'sql' is used by 1 unfinished requests"):
        model.unregister_adapter("sql")
    eng.abort(rid)
    assert model.registry.in_use["sql"] == 0


def test_concurrent_streams_equal_offline(pair):
    model, oracle = pair
    eng = engine(model)
    ps = prompts(5, seed=10)

    async def one(p, a):
        tokens = []
        async for out in eng.stream(p, adapter=a, max_new_tokens=6, **GEN):
            tokens.extend(out.new_token_ids)
            last = out
        assert last.finished and last.ttft is not None and last.ttft >= 0
        return tokens

    async def all_of_them():
        return await asyncio.gather(*(one(p, a) for p, a in zip(ps, ADAPTERS)))

    got = asyncio.run(all_of_them())
    assert got == [peft_tokens(oracle, p, a, 6) for p, a in zip(ps, ADAPTERS)]
    assert eng.pool.num_free == eng.pool.num_blocks


def test_learned_release_equals_static_generate(pair):
    from lorazor import LearnedRelease

    model, _ = pair
    g = torch.Generator().manual_seed(11)
    H = model.model.config.hidden_size
    heads = {a: (torch.randn(H, generator=g), 0.3, 0.0) for a in ("math", "sql")}  # med: no head, never releases
    policy = LearnedRelease(heads)
    saved = model.config
    model.release_policy = policy
    model.config = saved.__class__(**{**saved.to_dict(), "release": "learned"})
    try:
        ps = prompts(6, seed=12)
        eng = engine(model, num_kv_blocks=9, max_num_batched_tokens=8)  # preemptions replay the decisions
        outs = eng.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=8, **GEN) for p, a in zip(ps, ADAPTERS)])
        released = 0
        for p, a, o in zip(ps, ADAPTERS, outs):
            ref = model.generate(
                torch.tensor([p], device=model.device), adapter_ids=[a], max_new_tokens=8, do_sample=False, **GEN
            )
            assert o.token_ids == ref.sequences[0, len(p):].tolist()
            assert o.release_step == int(ref.release_steps[0]), a
            released += o.release_step >= 0
        assert released > 0  # the heads really released some requests
    finally:
        model.release_policy, model.config = None, saved


def test_triton_paged_attention_engine_equals_peft():
    # The GPU path's kernels under the Triton interpreter: paged attention for decode tiles and
    # prefill tiles (the 40-token prompt's first chunk spans two tiles of 32), LoRA kernels.
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False, backend="triton", attention="triton"))
    assert model.runner.triton_attention and model.context.backend == "triton"
    ps = [prompts(1, seed=22, base=40)[0]] + prompts(3, seed=21)
    adapters = ["med", "math", None, "sql"]
    eng = engine(model, max_num_batched_tokens=44, num_kv_blocks=40)
    assert eng.cache.use_kernel
    outs = eng.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=5, **GEN) for p, a in zip(ps, adapters)])
    for p, a, o in zip(ps, adapters, outs):
        assert o.token_ids == peft_tokens(oracle, p, a, 5), a


def test_compiled_engine_equals_peft_with_one_compile_for_every_batch():
    # torch.compile of the engine's decode step (the paged attention an opaque custom op) with a
    # dynamic batch: staggered requests give decode steps of 2, 3 and 4 rows, all one compile.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # count this model's compiles alone (compiled code is shared by code object)
    counters.clear()
    model, oracle = build_pair("llama", LoRazorConfig(compile=True, cuda_graphs=False))
    eng = LoRazorEngine(model, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    ps = prompts(7, seed=31)
    adapters = ["math", None, "sql", "med", "math", "sql", "med"]
    lengths = [4 + 2 * i for i in range(7)]
    ids, done = [], {}

    def step():
        done.update((out.request_id, out) for out in eng.step() if out.finished)

    for p, a, n in zip(ps, adapters, lengths):
        ids.append(eng.add_request(p, adapter=a, max_new_tokens=n, **GEN))
        step()
    while eng.has_unfinished():
        step()
    for i, p, a, n in zip(ids, ps, adapters, lengths):
        assert done[i].token_ids == peft_tokens(oracle, p, a, n), a
    assert dict(counters["graph_break"]) == {}
    # Each region (decoder layer, final norm, rotary embedding) compiles at most twice: batch 1 is its
    # own specialization (dynamo always specializes 1); the layer number is dynamic from the first
    # compile. A graph per batch size or per layer would make seven or more.
    compiles = model.runner.compiled_layers.compiles()
    assert set(compiles) == {"LlamaDecoderLayer", "LlamaRMSNorm", "LlamaRotaryEmbedding"}
    assert 1 <= min(compiles.values()) and max(compiles.values()) <= 2, compiles


def test_engine_refuses_too_long_requests(pair):
    model, _ = pair
    with pytest.raises(ValueError, match="max_model_len=10000 exceeds the model's max_position_embeddings=512"):
        LoRazorEngine(model, num_kv_blocks=8, max_model_len=10000)
    eng = LoRazorEngine(model, num_kv_blocks=64, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="= 22 tokens exceeds max_model_len=20"):
        eng.add_request(list(range(3, 15)), max_new_tokens=10, **GEN)
    assert eng.generate([dict(prompt_ids=list(range(3, 13)), max_new_tokens=10, **GEN)])[0].finish_reason


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_padded_packed_steps_equal_static_generate(compile):
    # The GPU's graphed steps with prefill chunks, run eagerly under the Triton interpreter: tokens
    # padded to a bucket of 256, attention tiles padded with empty tiles, last-token indices; with
    # compile, through torch.compile with a dynamic token count.
    from lorazor.runner.paged_graphs import PackedStepGraphs
    from torch._dynamo.utils import counters

    counters.clear()
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False, backend="triton", attention="triton",
                                                      compile=compile))
    eng = engine(model, max_num_batched_tokens=44, num_kv_blocks=40)

    class PaddedOnly:  # decode-only steps eager, packed ones through the padded bucket
        packed = PackedStepGraphs(model.runner, eng.cache, 44, 8, pool=None, capture=False)

        def serves(self, batch):
            return False

    eng.steps.graphs = PaddedOnly()
    eng.graphs.grid = model.context.grid

    def compiles():  # dynamo's compiled decoder layers (its code object's: every runner's so far)
        return model.runner.compiled_layers.compiles()["LlamaDecoderLayer"] if compile else 0

    before = compiles()
    ps = [prompts(1, seed=22, base=40)[0]] + prompts(4, seed=23)
    adapters = ["med", "math", None, "sql", "math"]
    outs = eng.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=5, release=[None, 1][i % 2], **GEN)
                         for i, (p, a) in enumerate(zip(ps, adapters))])
    engine_compiles = compiles() - before
    assert PaddedOnly.packed.buckets, "no packed step went through the padded path"
    for i, (p, a, o) in enumerate(zip(ps, adapters, outs)):
        ref = model.generate(torch.tensor([p], device=model.device), adapter_ids=[a], release=[[None, 1][i % 2]],
                             max_new_tokens=5, do_sample=False, **GEN)
        assert o.token_ids == ref.sequences[0, len(p):].tolist(), a
    assert dict(counters["graph_break"]) == {}
    if compile:  # per step kind and graph key (LoRA, backbone), two compiles of the decoder layer (the
        # second makes the layer number dynamic) and one for batch 1 decode steps; none per bucket or layer
        assert 1 <= engine_compiles <= 6, engine_compiles


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_bucketed_steps_async_equal_static_generate(compile, monkeypatch):
    # The GPU's bucketed steps, decode-only and packed, run eagerly under the Triton interpreter
    # (no capture): rows padded to a bucket, inputs uploaded into the bucket's staging rows, and with
    # async scheduling each decode row's token and release decision filled on the device from the step
    # before. Each request equals static generate; compiled, one compile per step kind.
    from lorazor.runner import paged_graphs
    from lorazor.runner.paged_graphs import PagedDecodeGraphs
    from torch._dynamo.utils import counters

    filled = []
    real_fill = paged_graphs.fill_pending
    monkeypatch.setattr(paged_graphs, "fill_pending", lambda *a: filled.append(a[0].shape[0]) or real_fill(*a))
    counters.clear()
    model, _ = build_pair("llama", LoRazorConfig(cuda_graphs=False, backend="triton", attention="triton",
                                                 compile=compile))
    eng = engine(model, max_num_batched_tokens=44, num_kv_blocks=60, async_scheduling=True)
    eng.steps.graphs = PagedDecodeGraphs(model.runner, eng.cache, 8, 44, capture=False)
    def compiles():  # dynamo's compiled decoder layers (its code object's: every runner's so far)
        return model.runner.compiled_layers.compiles()["LlamaDecoderLayer"] if compile else 0

    before = compiles()
    ps = prompts(7, seed=31)
    adapters = ["med", "math", None, "sql", "math", "med", None]
    releases = [None, 1, "never", 2, 0, None, "never"]
    requests = [dict(prompt_ids=p, adapter=a, max_new_tokens=6 + i % 3, release=r, **GEN)
                for i, (p, a, r) in enumerate(zip(ps, adapters, releases))]
    ids = [eng.add_request(**r) for r in requests[:4]]
    for _ in range(3):  # a running batch, then a second wave joins it
        eng.step()
    ids += [eng.add_request(**r) for r in requests[4:]]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.graphs.buckets and eng.graphs.packed.buckets, "a step kind did not go through its buckets"
    assert len(filled) >= 5 and set(filled) <= {1, 2, 4, 8, 256}  # bucket tensors, filled on the device
    engine_compiles = compiles() - before
    for i, (p, a, r) in enumerate(zip(ps, adapters, releases)):
        ref = model.generate(torch.tensor([p], device=model.device), adapter_ids=[a], release=[r],
                             max_new_tokens=6 + i % 3, do_sample=False, **GEN)
        assert done[ids[i]].token_ids == ref.sequences[0, len(p):].tolist(), (i, a, r)
    assert dict(counters["graph_break"]) == {}
    if compile:  # as above: a few per step kind and graph key, none per bucket or layer
        assert 1 <= engine_compiles <= 8, engine_compiles


def test_every_bucket_writes_one_shared_output_buffer_and_host_sampled_rows_read_theirs_first():
    # The GPU's buckets (decode and packed) run eagerly here, in program order, so a step whose
    # logits the host reads after the next step has overwritten them would give wrong tokens: a
    # repetition penalty and log-probabilities make the host read its rows' logits, async scheduling
    # queues the next step early. Every bucket's outputs are views of one buffer (with a 128k
    # vocabulary, a pair per bucket held GBs at 512 seats).
    from lorazor.runner.paged_graphs import PagedDecodeGraphs

    model, _ = build_pair("llama", LoRazorConfig(cuda_graphs=False, backend="triton", attention="triton"))
    eng = engine(model, max_num_batched_tokens=44, num_kv_blocks=60, async_scheduling=True)
    eng.steps.graphs = PagedDecodeGraphs(model.runner, eng.cache, 8, 44, capture=False)
    ps = prompts(5, seed=41)
    adapters = ["med", None, "math", "sql", "math"]
    host = [dict(repetition_penalty=1.5), {}, dict(logprobs=2), {}, dict(repetition_penalty=1.3)]
    outs = eng.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=6, **h, **GEN)
                         for p, a, h in zip(ps, adapters, host)])
    for p, a, h, o in zip(ps, adapters, host, outs):
        settings = {k: v for k, v in h.items() if k != "logprobs"}
        ref = model.generate(torch.tensor([p], device=model.device), adapter_ids=[a], max_new_tokens=6,
                             do_sample=False, **settings, **GEN)
        assert o.token_ids == ref.sequences[0, len(p):].tolist(), (a, h)
    buckets = list(eng.graphs.buckets.values()) + list(eng.graphs.packed.buckets.values())
    assert eng.graphs.buckets and eng.graphs.packed.buckets, "a step kind did not go through its buckets"
    bases = {t.untyped_storage().data_ptr() for b in buckets for t in (b.logits, b.hidden) if t is not None}
    assert len(bases) == 2, "each bucket holds its own outputs"


def test_sliding_window_models_are_refused_past_the_window(pair):
    model, _ = pair
    cfg = model.model.config
    cfg.sliding_window = 64
    try:
        with pytest.raises(NotImplementedError, match="max_model_len=512 exceeds the model's sliding_window=64"):
            LoRazorEngine(model, num_kv_blocks=8)
        eng = LoRazorEngine(model, num_kv_blocks=16, block_size=4, max_model_len=64)  # within the window: served
        assert eng.generate([dict(prompt_ids=prompts(1)[0], max_new_tokens=3, **GEN)])[0].finish_reason
    finally:
        cfg.sliding_window = None


def test_warm_up_captures_only_the_adapter_classes_a_bucket_can_reach():
    # A step of b rows uses at most b distinct adapters, so its graph key's class is at most b's class:
    # the warm-up leaves the larger classes of small buckets out, and a step never asks for one.
    from lorazor.lora.context import StepContext
    from lorazor.runner.paged_graphs import reachable_keys

    context = StepContext(num_slots=128, grid="exact", backend="reference")
    assert reachable_keys(context, 1) == reachable_keys(context, 16) == [(True, 16), (False, None)]
    assert reachable_keys(context, 17) == [(True, 16), (True, 32), (False, None)]
    assert reachable_keys(context, 48) == [(True, 16), (True, 32), (True, 64), (False, None)]
    assert reachable_keys(context, 256) == [(True, b) for b in (16, 32, 64, 128)] + [(False, None)]
    for rows in range(1, 300):
        keys = reachable_keys(context, rows)
        for distinct in range(1, min(rows, 128) + 1):  # every key a step of this many rows can have
            context.set_distinct(distinct)
            assert (True, context.slot_bound) in keys, (rows, distinct)
    assert reachable_keys(StepContext(20, "exact", "reference"), 8) == [(True, 16), (False, None)]
    assert reachable_keys(StepContext(20, "exact", "reference"), 17) == [(True, 16), (True, 20), (False, None)]
    assert reachable_keys(StepContext(20, "full", "reference"), 300) == [(True, None), (False, None)]


def test_outputs_share_the_tokens_but_each_keeps_its_own_snapshot(pair):
    # A step's outputs point into their requests' token lists (no copy per step, so a step's host
    # time does not grow with the outputs' lengths), yet an output read later still shows the tokens
    # of its own step.
    import copy
    import dataclasses

    from lorazor.engine.request import TokenPrefix

    model, _ = pair
    eng = engine(model, async_scheduling=False)
    rid = eng.add_request(prompts(1, seed=40)[0], adapter="math", max_new_tokens=6, **GEN)
    seen = []
    while eng.has_unfinished():
        seen += [o for o in eng.step() if o.request_id == rid]
    assert [o.num_tokens for o in seen] == list(range(1, 7))
    source = seen[-1].tokens.source
    final = seen[-1].token_ids
    for i, out in enumerate(seen[:-1]):
        assert isinstance(out.tokens, TokenPrefix) and out.tokens.source is source
        assert out.token_ids == final[:i + 1] and out.tokens == final[:i + 1] and out.tokens != final
        assert list(out.tokens) == final[:i + 1] and out.tokens[-1] == final[i] and out.tokens[1:] == final[1:i + 1]
        assert dataclasses.asdict(out)["tokens"] == final[:i + 1] and copy.deepcopy(out.tokens) == final[:i + 1]
        with pytest.raises(IndexError):
            out.tokens[i + 1]
    assert seen[-1].token_ids is seen[-1].token_ids  # made once, then kept


def test_a_cold_adapters_folder_is_read_while_the_other_requests_step(tmp_path, monkeypatch):
    # A request whose adapter is on disk waits while its folder is read on a host thread; the
    # running request keeps getting a token every step meanwhile (was: the step read the folder
    # first); then it runs, with the adapter's own tokens, and the load counts as a disk load.
    import threading

    from lorazor.adapters.folder_reader import FolderReader

    release = threading.Event()
    real = FolderReader.read

    def slow_read(reader, source):
        assert release.wait(timeout=60), "the test never released the read"
        return real(reader, source)

    monkeypatch.setattr(FolderReader, "read", slow_read)  # before the model: its read-ahead binds the method
    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False))
    oracle.save_pretrained(tmp_path, selected_adapters=["sql"])
    model.register_adapter("sql_disk", tmp_path / "sql")
    eng = engine(model)
    ps = prompts(2, seed=23)
    warm = eng.add_request(ps[0], adapter="math", max_new_tokens=12, **GEN)
    cold = eng.add_request(ps[1], adapter="sql_disk", max_new_tokens=4, **GEN)
    done = {}
    for _ in range(5):  # the folder's read is held: five steps run without it
        done.update({o.request_id: o for o in eng.step() if o.finished})
    # With async scheduling (the GPU's default) a step's tokens come back with the next step.
    assert len(eng.requests[warm].output) == 5 - eng.async_scheduling
    assert eng.requests[cold].status.name == "WAITING"
    assert "sql_disk" in model.registry.read_ahead.reading
    disk_loads = model.registry.load_times.counts.get("disk", [0])
    release.set()
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[warm].token_ids == peft_tokens(oracle, ps[0], "math", 12)
    assert done[cold].token_ids == peft_tokens(oracle, ps[1], "sql", 4)
    assert sum(model.registry.load_times.counts["disk"]) == sum(disk_loads) + 1


def test_a_cold_adapter_whose_folder_breaks_ends_only_its_requests(tmp_path):
    import shutil

    model, oracle = build_pair("llama", LoRazorConfig(cuda_graphs=False))
    oracle.save_pretrained(tmp_path, selected_adapters=["sql"])
    model.register_adapter("sql_disk", tmp_path / "sql")
    shutil.rmtree(tmp_path / "sql")  # gone after registration
    eng = engine(model)
    ps = prompts(2, seed=24)
    outs = eng.generate([dict(prompt_ids=ps[0], adapter="math", max_new_tokens=6, **GEN),
                         dict(prompt_ids=ps[1], adapter="sql_disk", max_new_tokens=6, **GEN)])
    assert outs[0].token_ids == peft_tokens(oracle, ps[0], "math", 6)
    assert outs[1].finish_reason == "error" and "sql_disk" in model.registry.broken
