"""One runner under `generate()` and the engine: a user's own release policy decides the same way in
both, and the engine and the caches reach the model only through the runner's public methods."""

import ast
import re
from pathlib import Path

import pytest
import torch
from helpers import EOS, PAD, build_pair
from lorazor import LoRazorConfig, LoRazorEngine, ReleasePolicy

GEN = dict(pad_token_id=PAD, eos_token_id=EOS)
SRC = Path(__file__).resolve().parents[2] / "src" / "lorazor"
ADAPTERS = ["math", "sql", "med", None, "math", "sql"]


class StepOrNormRelease(ReleasePolicy):
    """A user's own graph-safe policy: release after k decode forwards per adapter (per-slot tensor
    from `bind`), or as soon as the hidden state is not finite (it reads the hidden state)."""

    graph_safe = True

    def __init__(self, lengths):
        super().__init__()
        self.lengths = lengths

    def adapter_names(self):
        return list(self.lengths)

    def bind(self, adapter_names, num_slots, device):
        k = torch.full((num_slots + 1,), 10**9, dtype=torch.long)
        for slot, name in enumerate(adapter_names):
            if name in self.lengths:
                k[slot] = self.lengths[name]
        self.bound = {"k": k.to(device)}

    def keep(self, step, hidden, state):
        # `step` is an int or 0-d tensor in generate() and a [B] tensor in the engine: broadcasts.
        return (step < self.bound["k"][state.slot.long()]) & torch.isfinite(hidden.float()).all(-1)


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def reference(model, prompt, adapter, policy, max_new_tokens):
    return model.generate(torch.tensor([prompt], device=model.device), adapter_ids=[adapter], release_policy=policy,
                          max_new_tokens=max_new_tokens, do_sample=False, **GEN)


def check_custom_policy(model, policy, engine_kw):
    ps = prompts(len(ADAPTERS), seed=31)
    refs = [reference(model, p, a, policy, 9) for p, a in zip(ps, ADAPTERS)]
    # Per request, and as the model's default (`set_release_policy`).
    per_request = LoRazorEngine(model, **engine_kw).generate(
        [dict(prompt_ids=p, adapter=a, release_policy=policy, max_new_tokens=9, **GEN) for p, a in zip(ps, ADAPTERS)])
    model.set_release_policy(policy)
    try:
        by_default = LoRazorEngine(model, **engine_kw).generate(
            [dict(prompt_ids=p, adapter=a, max_new_tokens=9, **GEN) for p, a in zip(ps, ADAPTERS)])
        assert model.config.release == "custom"
    finally:
        model.set_release_policy(None)
    for outs in (per_request, by_default):
        for p, a, o, ref in zip(ps, ADAPTERS, outs, refs):
            assert o.token_ids == ref.sequences[0, len(p):].tolist(), a
            assert o.release_step == int(ref.release_steps[0]), a
            assert (o.decode_steps, o.lora_decode_steps) == (int(ref.decode_steps[0]), int(ref.lora_decode_steps[0]))
    steps = [o.release_step for o in per_request]
    assert steps[:3] == [2, 0, -1] and steps[4] == 2, steps  # it really released, at each adapter's k


def test_custom_policy_same_tokens_in_engine_and_generate():
    model, _ = build_pair("llama", LoRazorConfig())
    # A small pool and budget: preemptions replay the decisions.
    check_custom_policy(model, StepOrNormRelease({"math": 2, "sql": 0}),
                        dict(max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=12, block_size=4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_policy_same_tokens_in_engine_and_generate_with_graphs(dtype):
    model, _ = build_pair("llama", LoRazorConfig(cuda_graphs=True), dtype=dtype)
    assert model.uses_graphs
    kw = dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64, block_size=16)
    assert LoRazorEngine(model, **kw).graphs is not None
    check_custom_policy(model, StepOrNormRelease({"math": 2, "sql": 0}), kw)
    assert model.graphs is not None and model.graphs.num_graphs() > 0  # generate() replayed graphs too


def test_engine_and_server_use_only_the_runners_public_methods():
    hits = []
    for folder in ("engine", "serve", "ray"):
        for path in (SRC / folder).glob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"model\._", line):
                    hits.append(f"{path.name}:{n}: {line.strip()}")
    assert not hits, hits


@pytest.mark.parametrize("folder", ["runner", "policies", "adapters"])
def test_runner_and_caches_import_nothing_from_the_engine(folder):
    for path in (SRC / folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
                assert "engine" not in target and "serve" not in target, f"{path.name} imports {target}"


def test_engine_rebinds_a_policy_that_generate_bound_since():
    # generate() binds the policy to the bank as it is then; the engine must not trust its own last bind.
    from lorazor.runner.release import BoundPolicies

    model, _ = build_pair("llama", LoRazorConfig())
    policy = StepOrNormRelease({"math": 2})
    bound = BoundPolicies(model.bank, model.device)
    bound.bound(policy)
    first = policy.bound["k"]
    policy.bind([None] * model.bank.num_slots, model.bank.num_slots, model.device)  # as another caller might
    assert bound.bound(policy).bound["k"] is not first
    assert torch.equal(policy.bound["k"], first)  # rebound to the bank's adapters again
    assert bound.bound(policy).bound["k"] is policy.bound["k"]  # and not again while nothing changed


class Broken(StepOrNormRelease):
    def keep(self, step, hidden, state):
        raise RuntimeError("this policy is broken")


def test_a_failing_policy_ends_only_its_own_requests():
    model, _ = build_pair("llama", LoRazorConfig())
    ps = prompts(2, seed=41)
    engine = LoRazorEngine(model, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=32, block_size=4)
    bad, good = engine.generate([
        dict(prompt_ids=ps[0], adapter="math", release_policy=Broken({"math": 2}), max_new_tokens=8, **GEN),
        dict(prompt_ids=ps[1], adapter="math", release_policy=StepOrNormRelease({"math": 2}), max_new_tokens=8,
             **GEN)])
    assert bad.finish_reason == "error" and "Broken failed" in bad.error and "this policy is broken" in bad.error
    ref = reference(model, ps[1], "math", StepOrNormRelease({"math": 2}), 8)
    assert good.token_ids == ref.sequences[0, len(ps[1]):].tolist()
    assert good.release_step == int(ref.release_steps[0]) == 2


class FailsAfter:
    """A logits processor (the engine samples its request on the host) that raises at its `n`-th call."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls >= self.n:
            raise ValueError("this processor is broken")
        return scores


class StopFailsAfter:
    """A request's stop check (`GenerationPlan.stop_reason`) that raises at its `n`-th call."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, tokens, token, generated, scores):
        self.calls += 1
        if self.calls >= self.n:
            raise ValueError("this criterion is broken")
        return None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step_by_step", "async"])
def test_a_request_whose_own_code_raises_ends_alone(async_scheduling, monkeypatch):
    # A request's logits processor raising mid-generation, and a stop check raising, end those two
    # requests with finish reason "error" and the reason; the requests beside them finish as alone.
    from lorazor.engine import outputs

    model, _ = build_pair("llama", LoRazorConfig())
    ps = prompts(4, seed=43)
    engine = LoRazorEngine(model, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=4,
                           async_scheduling=async_scheduling)
    broken_stop = StopFailsAfter(3)
    real_reasons = outputs.stop_reasons

    def reasons(appended):  # the stop check of one request raises at its third token
        for request, _ in appended:
            if request.request_id == "stop-raises":
                request.plan.stop_reason = broken_stop
        return real_reasons(appended)

    monkeypatch.setattr("lorazor.engine.outputs.stop_reasons", reasons)
    specs = [dict(prompt_ids=ps[0], adapter="math", max_new_tokens=8, logits_processor=[FailsAfter(4)],
                  request_id="sample-raises"),
             dict(prompt_ids=ps[1], adapter="sql", max_new_tokens=8, request_id="stop-raises"),
             dict(prompt_ids=ps[2], adapter="math", max_new_tokens=8, request_id="good-1"),
             dict(prompt_ids=ps[3], adapter=None, max_new_tokens=8, logits_processor=[FailsAfter(99)],
                  request_id="good-2")]
    outs = {o.request_id: o for o in engine.generate([dict(s, **GEN) for s in specs])}
    bad = outs["sample-raises"]
    assert bad.finish_reason == "error" and "sampling failed: ValueError: this processor is broken" in bad.error
    assert bad.num_tokens == 3  # the three tokens sampled before the processor broke
    bad = outs["stop-raises"]
    assert bad.finish_reason == "error" and "stop check failed: ValueError: this criterion is broken" in bad.error
    for i, name in ((2, "good-1"), (3, "good-2")):
        ref = model.generate(torch.tensor([ps[i]], device=model.device), adapter_ids=[specs[i]["adapter"]],
                             max_new_tokens=8, do_sample=False, **GEN)
        assert outs[name].finish_reason == "length" and outs[name].error is None
        assert outs[name].token_ids == ref.sequences[0, len(ps[i]):].tolist(), name
