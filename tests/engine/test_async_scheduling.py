"""Async scheduling: the engine queues step n+1 before it reads step n back, and gives what the
step-by-step engine gives, request for request."""

import dataclasses
import random

import pytest
import torch
from helpers import EOS, PAD, build_pair
from lorazor import LoRazorConfig, LoRazorEngine
from lorazor.runner.launched import LaunchedStep

GEN = dict(pad_token_id=PAD, eos_token_id=EOS)
TIMES = ("arrival_time", "first_token_time", "finish_time", "scheduled_time")


@pytest.fixture(scope="module")
def model():
    return build_pair("llama", LoRazorConfig(cuda_graphs=False))[0]


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (3 + 5 * i % 13,), generator=g).tolist() for i in range(n)]


def engine(model, **kw):
    """Async by default here (on the CPU the engine's default is step by step)."""
    return LoRazorEngine(model, **{"max_num_seqs": 6, "max_num_batched_tokens": 24, "num_kv_blocks": 40,
                                   "block_size": 4, "async_scheduling": True, **kw})


def outcome(outputs):
    """Every field of each finished output but the timestamps."""
    return {o.request_id: {k: v for k, v in dataclasses.asdict(o).items() if k not in TIMES} for o in outputs}


def run(eng, requests, stagger=True):
    """Requests join one per step (with `stagger`), then run to the end; returns the finished outputs."""
    done = []
    for r in requests:
        eng.add_request(**r)
        if stagger:
            done += [o for o in eng.step() if o.finished]
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.scheduler.running
    return done


def mixed_requests(model, seed, host_sampled):
    """Greedy rows with and without release (fixed lengths, `never`), the backbone, a row that stops
    at an EOS it reaches mid-way and, with `host_sampled`, rows the host samples (log-probabilities,
    a repetition penalty), whose steps are read back at once."""
    ps = prompts(10, seed)
    adapters = ["math", "sql", None, "med", "math", "sql", "med", None, "math", "sql"]
    releases = [None, 0, None, 2, "never", 1, None, None, 3, None]
    reqs = [dict(prompt_ids=p, adapter=a, release=r, max_new_tokens=6 + i % 4, request_id=f"r{i}", **GEN)
            for i, (p, a, r) in enumerate(zip(ps, adapters, releases))]
    # A stop token this request first generates after a few tokens: it must end there, with nothing after it.
    tokens = engine(model, async_scheduling=False).generate([dict(reqs[3], request_id="probe")])[0].token_ids
    stop_at = next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])
    reqs[3]["eos_token_id"] = tokens[stop_at]
    reqs[3]["stop_at"] = stop_at
    if host_sampled:
        reqs[5]["logprobs"] = 2
        reqs[6]["repetition_penalty"] = 1.3
    return reqs


@pytest.mark.parametrize("host_sampled", [False, True], ids=["device_sampled", "some_host_sampled"])
@pytest.mark.parametrize("blocks", [40, 9], ids=["roomy_pool", "preempting_pool"])
def test_async_engine_equals_the_step_by_step_engine(model, blocks, host_sampled, monkeypatch):
    reqs = mixed_requests(model, seed=1, host_sampled=host_sampled)
    stop_at = reqs[3].pop("stop_at")
    sync = engine(model, num_kv_blocks=blocks, async_scheduling=False)
    expected = outcome(run(sync, reqs))
    # Count the steps that took input tokens still on the device (the overlap actually happens).
    overlapped = []
    real = LaunchedStep.pending_for
    monkeypatch.setattr(LaunchedStep, "pending_for",
                        lambda self, inputs: overlapped.append(bool(inputs.pending)) or real(self, inputs))
    eng = engine(model, num_kv_blocks=blocks)
    assert outcome(run(eng, reqs)) == expected
    assert sum(overlapped) >= 5
    assert expected["r3"]["finish_reason"] == "eos" and len(expected["r3"]["tokens"]) == stop_at + 1
    assert (expected["r5"]["new_logprobs"] is not None) == host_sampled
    if blocks == 9:
        assert sync.scheduler.num_preemptions > 0 and eng.scheduler.num_preemptions > 0


def test_async_step_reports_the_step_before(model):
    p = prompts(1, seed=2)[0]
    sync, eng = engine(model, async_scheduling=False), engine(model)
    for e in (sync, eng):
        e.add_request(p, adapter="sql", max_new_tokens=3, **GEN)
    first = sync.step()
    assert len(first) == 1 and len(first[0].new_token_ids) == 1
    assert eng.step() == []  # queued, not read back yet
    assert [o.new_token_ids for o in eng.step()] == [first[0].new_token_ids]
    rest = [o for o in eng.step()] + [o for o in eng.step()]
    assert rest[-1].finished and rest[-1].token_ids == sync.generate([dict(prompt_ids=p, adapter="sql",
                                                                           max_new_tokens=3, **GEN)])[0].token_ids
    assert eng.step() == [] and not eng.has_unfinished()


def test_a_request_aborted_in_flight_gets_nothing_more(model):
    ps = prompts(3, seed=3)
    eng = engine(model)
    ids = [eng.add_request(p, adapter=a, max_new_tokens=6, **GEN) for p, a in zip(ps, ["math", "sql", None])]
    eng.step()
    eng.step()  # the first tokens are read back; the next step is in flight
    assert eng.abort(ids[0]).finish_reason == "abort"
    later = []
    while eng.has_unfinished():
        later += eng.step()
    assert ids[0] not in {o.request_id for o in later}
    expected = engine(model, async_scheduling=False).generate(
        [dict(prompt_ids=p, adapter=a, max_new_tokens=6, **GEN) for p, a in zip(ps[1:], ["sql", None])])
    assert [o.token_ids for o in later if o.finished] == [o.token_ids for o in expected]
    assert eng.pool.num_free == eng.pool.num_blocks


def test_async_scheduling_is_on_where_a_gpu_runs_the_steps(model):
    assert LoRazorEngine(model, num_kv_blocks=8).async_scheduling is (model.device.type == "cuda")
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None, got 'yes'"):
        engine(model, async_scheduling="yes")


def random_trace(eng, seed):
    """Twelve requests of random prompts, lengths, adapters, releases, stop tokens and logprobs, joining
    over random numbers of steps, some aborted; the finished outputs of those not aborted."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    done, aborted = [], set()
    for i in range(12):
        kw = dict(GEN, max_new_tokens=rng.randint(1, 8), release=rng.choice([None, 0, 1, 3, "never"]))
        if rng.random() < 0.2:
            kw["eos_token_id"] = rng.randint(3, 95)
        if rng.random() < 0.15:
            kw["logprobs"] = 1
        eng.add_request(torch.randint(3, 96, (rng.randint(1, 14),), generator=g).tolist(),
                        adapter=rng.choice(["math", "sql", "med", None]), request_id=f"r{i}", **kw)
        for _ in range(rng.randint(0, 2)):
            done += [o for o in eng.step() if o.finished]
        if rng.random() < 0.15 and eng.requests:
            victim = sorted(eng.requests)[0]
            eng.abort(victim)
            aborted.add(victim)
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert eng.pool.num_free == eng.pool.num_blocks
    return {rid: out for rid, out in outcome(done).items() if rid not in aborted}


@pytest.mark.parametrize("seed", range(6))
def test_random_traces_equal_the_step_by_step_engine(model, seed):
    # Random budgets and pool sizes (preemption), stop tokens, releases, host-sampled rows and aborts.
    rng = random.Random(100 + seed)
    kw = dict(max_num_seqs=rng.choice([2, 4, 7]), max_num_batched_tokens=rng.choice([8, 16, 40]),
              num_kv_blocks=rng.choice([10, 14, 40]))
    got, want = (random_trace(engine(model, async_scheduling=mode, **kw), seed) for mode in (True, False))
    # An abort picks the oldest unfinished request, which the one-step lag can change: compare the
    # requests neither run aborted.
    common = got.keys() & want.keys()
    assert len(common) >= 8
    for rid in common:  # log-probabilities of rows batched differently agree to float tolerance
        a, b = got[rid].pop("new_logprobs"), want[rid].pop("new_logprobs")
        assert got[rid] == want[rid], rid
        assert (a is None) == (b is None) and (a is None or a[0][0] == pytest.approx(b[0][0], abs=1e-5)), rid
