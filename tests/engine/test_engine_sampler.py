"""The engine's batched sampler: per-row HF warper settings give, row by row, HF's own processed scores."""

import pytest
import torch
from helpers import EOS, PAD
from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
from lorazor.runner.sampling import batchable, sample, warp
from lorazor.tiny import tiny_peft_model

SETTINGS = [
    dict(do_sample=True),
    dict(do_sample=True, temperature=0.7),
    dict(do_sample=True, top_k=5),
    dict(do_sample=True, top_k=0, top_p=0.8),
    dict(do_sample=True, top_k=0, min_p=0.2),
    dict(do_sample=True, temperature=1.3, top_k=7, top_p=0.9, min_p=0.05),
    dict(do_sample=True, top_k=1),
    dict(do_sample=True, temperature=0.5, top_k=0, top_p=0.3),
    dict(do_sample=True, top_k=0, top_p=0.0),  # only the kept-at-least-one token survives
]


@pytest.fixture(scope="module")
def engine():
    model = LoRazorModel.from_peft(tiny_peft_model("llama"), LoRazorConfig(cuda_graphs=False))
    return LoRazorEngine(model, num_kv_blocks=64, block_size=4)


def test_each_row_gets_hf_processed_scores(engine):
    g = torch.Generator().manual_seed(0)
    requests = [engine.prepare_request([5, 6, 7], max_new_tokens=4, pad_token_id=PAD, **kw) for kw in SETTINGS]
    params = [batchable(r.plan, None) for r in requests]
    assert all(p is not None for p in params)
    vocab = engine.model.model.get_input_embeddings().num_embeddings
    logits = torch.randn(len(SETTINGS), vocab, generator=g) * 3
    batched = warp(logits, params)
    ids = torch.tensor([[5, 6, 7]])
    for i, r in enumerate(requests):
        alone = r.plan.processors(ids, logits[i:i + 1].clone())[0]
        assert torch.equal(batched[i].isinf(), alone.isinf()), SETTINGS[i]
        finite = alone.isfinite()
        torch.testing.assert_close(batched[i][finite], alone[finite])
        assert finite.sum() < vocab or SETTINGS[i] in (SETTINGS[0], SETTINGS[1])  # the warper really filtered


def test_samples_stay_inside_each_rows_allowed_tokens(engine):
    g = torch.Generator().manual_seed(1)
    requests = [engine.prepare_request([5], max_new_tokens=2, pad_token_id=PAD, **kw) for kw in SETTINGS]
    params = [batchable(r.plan, None) for r in requests]
    logits = torch.randn(len(SETTINGS), 96, generator=g) * 3
    allowed = warp(logits, params).isfinite()
    for _ in range(20):
        tokens = sample(logits, params)
        assert allowed[torch.arange(len(SETTINGS)), tokens].all()
    assert (sample(logits[6:7], params[6:7]) == logits[6].argmax()).all()  # top_k=1 is greedy


def test_what_is_not_batched(engine):
    def params(generator=None, **kw):
        return batchable(engine.prepare_request([5], max_new_tokens=2, pad_token_id=PAD, **kw).plan, generator)

    assert params(do_sample=False) is None  # greedy: the argmax path
    assert params(do_sample=True, repetition_penalty=1.2) is None  # another processor: HF per request
    assert params(torch.Generator().manual_seed(0), do_sample=True) is None  # a seeded request keeps its generator
    assert params(do_sample=True, top_k=3) is not None


def test_engine_sampling_runs_batched_and_seeded_requests_repeat(engine):
    out = engine.generate([dict(prompt_ids=[5, 6, 7], max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, **kw)
                           for kw in SETTINGS])
    assert all(len(o.token_ids) >= 1 for o in out)
    seeded = [engine.generate([dict(prompt_ids=[5, 6, 7], max_new_tokens=6, pad_token_id=PAD, do_sample=True,
                                    generator=torch.Generator().manual_seed(3))])[0].token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]
