"""Stop strings in the engine: the device samples such requests (greedy rows in the step's argmax,
sampled rows in the batched sampler) and the host checks the strings on the tokens it reads back, so
a request with `stop` keeps the step overlappable. Outputs equal `generate()` with HF's criteria."""

import pytest
import torch
from lorazor import LoRazorEngine, LoRazorModel
from lorazor.runner.launched import LaunchedStep

STOPS = [" FROM", "e ", "Step 3"]


@pytest.fixture(scope="module")
def testbed():
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    return LoRazorModel.from_peft(peft_model), tokenizer, tasks


def prompts_of(tokenizer, tasks):
    rows = [("sql", tasks["sql"].split("test")[0]["prompt"]), ("science", tasks["science"].split("test")[1]["prompt"]),
            (None, tasks["math"].split("test")[2]["prompt"]), ("math", tasks["math"].split("test")[0]["prompt"]),
            ("medqa", tasks["medqa"].split("test")[1]["prompt"])]
    return [(a, tokenizer(p)["input_ids"]) for a, p in rows]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step_by_step", "async"])
def test_stop_strings_are_checked_on_the_host_and_equal_generate(testbed, async_scheduling, monkeypatch):
    model, tokenizer, tasks = testbed
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id, stop_strings=STOPS,
              tokenizer=tokenizer)
    overlapped = []
    real = LaunchedStep.pending_for
    monkeypatch.setattr(LaunchedStep, "pending_for",
                        lambda self, inputs: overlapped.append(bool(inputs.pending)) or real(self, inputs))
    eng = LoRazorEngine(model, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=128, block_size=16,
                        async_scheduling=async_scheduling)
    rows = prompts_of(tokenizer, tasks)
    ids = [eng.add_request(p, adapter=a, **kw) for a, p in rows]
    assert all(eng.requests[i].plain_greedy for i in ids)  # sampled on the device, not one by one
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    reasons = []
    for rid, (adapter, prompt) in zip(ids, rows):
        ref = model.generate(torch.tensor([prompt], device=model.device), adapter_ids=[adapter], **kw)
        want = ref.sequences[0, len(prompt):].tolist()
        assert done[rid].token_ids == want, adapter
        reasons.append(done[rid].finish_reason)
    assert reasons.count("stop") >= 2  # the strings end some outputs early here
    assert any(overlapped) == async_scheduling  # async steps still overlap with stop strings


def test_sampled_requests_with_stop_strings_are_batched(testbed):
    model, tokenizer, tasks = testbed
    eng = LoRazorEngine(model, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=128, block_size=16)
    a, prompt = prompts_of(tokenizer, tasks)[0]
    rid = eng.add_request(prompt, adapter=a, max_new_tokens=8, do_sample=True, temperature=0.8,
                          stop_strings=STOPS, tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
    assert eng.requests[rid].sampling is not None
    while eng.has_unfinished():
        eng.step()


def test_batched_stop_checks_equal_hf_on_every_sequence(testbed):
    # Random sequences (some ending inside, some after a stop string): the engine's check (tail,
    # prefilter on the last token, one call per group) says "stop" exactly where HF's criterion on
    # the whole sequence does.
    from lorazor.engine.outputs import stop_reasons

    model, tokenizer, _ = testbed
    eng = LoRazorEngine(model, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=128, block_size=16)
    g = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    pairs, expected = [], []
    for i in range(300):
        stops = [["e ", " FROM"], ["th"], ["e ", " FROM"]][i % 3]  # two requests of three share their strings
        request = eng.prepare_request([5, 6, 7], adapter=None, max_new_tokens=1000, stop_strings=stops,
                                      tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
        out = torch.randint(3, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        for token in out:
            request.append(token)
        pairs.append((request, out[-1]))
        expected.append(bool(request.plan.stopping(torch.tensor([request.tokens]), None)[0]))
    got = [reason == "stop" for reason in stop_reasons(pairs)]
    assert got == expected and sum(expected) >= 5  # (7 stops with this seed)
