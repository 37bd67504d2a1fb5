"""One request never harms another in the engine: hostile sampling settings are made safe or refused at
admission, a row with non-finite logits ends alone, and a step that raises is retried without the
requests that make it fail. Every good request gets the tokens it gets alone."""

import pytest
import torch
from helpers import EOS, PAD, build_pair
from lorazor import LoRazorConfig, LoRazorEngine

GEN = dict(pad_token_id=PAD, eos_token_id=EOS, max_new_tokens=6)
ADAPTERS = ["math", "sql", None, "med"]


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", LoRazorConfig(cuda_graphs=False))


def engine(model, **kw):
    return LoRazorEngine(model, **{"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64,
                                   "block_size": 4, **kw})


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (5 + 2 * i,), generator=g).tolist() for i in range(n)]


def solo(model, prompt, adapter):
    return engine(model).generate([dict(prompt_ids=prompt, adapter=adapter, do_sample=False, **GEN)])[0].token_ids


def run_mixed(model, hostile: dict, **engine_kw):
    """Good greedy requests around one hostile request, all admitted together; returns (the good
    requests' outputs, their solo tokens, the hostile request's output)."""
    ps = prompts(len(ADAPTERS) + 1)
    eng = engine(model, **engine_kw)
    good = [eng.add_request(p, adapter=a, do_sample=False, **GEN) for p, a in zip(ps, ADAPTERS)]
    bad = eng.add_request(ps[-1], **{**GEN, **hostile})
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[r] for r in good], [solo(model, p, a) for p, a in zip(ps, ADAPTERS)], done[bad]


@pytest.mark.parametrize("hostile", [
    dict(do_sample=True, temperature=1e-39), dict(do_sample=True, temperature=1e-45),
    dict(do_sample=True, temperature=1e-300), dict(do_sample=True, temperature=0.0),
    dict(do_sample=True, top_k=2**63), dict(do_sample=True, top_k=2**63, adapter="sql"),
], ids=["temp_1e-39", "temp_1e-45", "temp_1e-300", "temp_0", "top_k_2**63", "top_k_2**63_adapter"])
def test_degenerate_sampling_is_made_safe(pair, hostile):
    model, _ = pair
    good, alone, bad = run_mixed(model, hostile)
    assert [o.token_ids for o in good] == alone
    assert all(o.finish_reason in ("length", "eos") for o in good)
    assert bad.finish_reason in ("length", "eos")
    if hostile.get("temperature", 1.0) < 1e-5:  # a vanishing temperature is greedy
        assert bad.token_ids == solo(model, prompts(len(ADAPTERS) + 1)[-1], hostile.get("adapter"))


@pytest.mark.parametrize("bad, message", [
    (dict(do_sample=True, repetition_penalty=1e-300), "repetition_penalty"),
    (dict(do_sample=True, repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(do_sample=True, temperature=float("nan")), "temperature"),
    (dict(do_sample=True, top_p=float("nan")), "top_p"),
])
def test_unsafe_settings_are_refused_naming_them(pair, bad, message):
    model, _ = pair
    with pytest.raises(ValueError, match=message):
        engine(model).add_request([5, 6, 7], **{**GEN, **bad})


def test_integer_floats_are_accepted(pair):
    model, _ = pair
    out = engine(model).generate([dict(prompt_ids=[5, 6, 7], do_sample=True, temperature=2, top_p=1, **GEN)])[0]
    assert out.finish_reason in ("length", "eos")


@pytest.fixture
def poisoned(pair):
    """The model with adapter "med"'s weights in its GPU slot turned to NaN (as a corrupt copy would
    leave them: registration refuses non-finite files), restored afterwards."""
    model, _ = pair
    bank = model.bank
    model.registry.make_resident(["med"])
    slot = bank.slot_of["med"]
    saved = {name: m.lora_b[slot].clone() for name, m in bank.modules.items()}
    for m in bank.modules.values():
        m.lora_b[slot].fill_(float("nan"))
    yield model
    for name, m in bank.modules.items():
        m.lora_b[slot].copy_(saved[name])


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.7),
                                      dict(do_sample=True, repetition_penalty=1.3)],
                         ids=["greedy", "batched_sampling", "host_sampled"])
def test_non_finite_logits_end_only_their_request(poisoned, sampling):
    model = poisoned
    ps = prompts(4, seed=3)
    clean = ["math", "sql", None]
    alone = [solo(model, p, a) for p, a in zip(ps, clean)]
    eng = engine(model)
    good = [eng.add_request(p, adapter=a, do_sample=False, **GEN) for p, a in zip(ps, clean)]
    bad = eng.add_request(ps[-1], adapter="med", **GEN, **sampling)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [done[r].token_ids for r in good] == alone
    assert done[bad].finish_reason == "error" and "non-finite" in done[bad].error
    assert done[bad].token_ids == []
    assert eng.pool.num_free == eng.pool.num_blocks


POISON = 77


def test_a_failing_step_is_bisected_to_its_culprit(pair, monkeypatch):
    """A step that raises because of one request (here: a fault injected for a poison token) is
    retried in parts: the culprit ends with "error", every other request gets its solo tokens."""
    model, _ = pair
    runner = model.runner
    original = runner.run_paged_step
    failures = []

    def faulty(cache, inputs, *args, **kwargs):
        if POISON in inputs.ids:
            failures.append(len(inputs.chunks))
            raise RuntimeError("injected fault")
        return original(cache, inputs, *args, **kwargs)

    ps = [p for p in prompts(6, seed=5) if POISON not in p]
    alone = [solo(model, p, a) for p, a in zip(ps, ADAPTERS)]
    monkeypatch.setattr(runner, "run_paged_step", faulty)
    eng = engine(model)
    good = [eng.add_request(p, adapter=a, do_sample=False, **GEN) for p, a in zip(ps, ADAPTERS)]
    bad = eng.add_request([5, POISON, 9], adapter="sql", do_sample=False, **GEN)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [done[r].token_ids for r in good] == alone
    assert all(done[r].finish_reason in ("length", "eos") for r in good)
    assert done[bad].finish_reason == "error" and "injected fault" in done[bad].error
    assert failures[0] == len(good) + 1 and failures[-1] == 1  # the whole step first, the culprit alone last
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_failing_step_in_flight_keeps_the_step_before(pair, monkeypatch):
    """With async scheduling, a failure while the step before is in flight keeps that step's tokens."""
    model, _ = pair
    runner = model.runner
    original = runner.run_paged_step
    calls = {"n": 0}

    def faulty(cache, inputs, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # once, mid-decode, with a step in flight
            raise RuntimeError("transient fault")
        return original(cache, inputs, *args, **kwargs)

    ps = prompts(3, seed=7)
    alone = [solo(model, p, a) for p, a in zip(ps, ADAPTERS)]
    monkeypatch.setattr(runner, "run_paged_step", faulty)
    eng = engine(model, async_scheduling=True)
    ids = [eng.add_request(p, adapter=a, do_sample=False, **GEN) for p, a in zip(ps, ADAPTERS)]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    # A transient fault: the retry of the whole step's parts succeeds, so nobody fails.
    assert [done[r].token_ids for r in ids] == alone
    assert all(done[r].finish_reason in ("length", "eos") for r in ids)
