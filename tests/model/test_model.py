"""LoRazorModel against PEFT's mixed-adapter `adapter_names` path: logits and greedy tokens."""

import pytest
import torch
from conftest import DEVICE
from helpers import EOS, PAD, assert_model_gives_peft_tokens, build_pair, make_batch, peft_generate, peft_names
from lorazor import LoRazorConfig
from lorazor.tiny import AdapterSpec

ARCHS = ["llama", "mistral", "qwen2"]
MIXED = ["math", None, "sql", "med", "math", None, "med"]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_logits_match_peft(arch):
    model, oracle = build_pair(arch)
    ids, mask = make_batch(7, 9, seed=1, pad_rows=(1, 4))
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(MIXED)).logits
    out = model(ids, mask, MIXED)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    # The adapters really change the logits: a run with no adapters must differ.
    base = model(ids, mask, [None] * 7)
    assert (base[real] - out[real]).abs().max() > 1e-3
    # ... and a backbone-only call leaves no state behind.
    torch.testing.assert_close(model(ids, mask, MIXED)[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("B, pad_rows", [(1, ()), (7, (0, 3, 5)), (5, (2,))])
def test_greedy_tokens_match_peft_mixed_batch(arch, B, pad_rows):
    model, oracle = build_pair(arch)
    ids, mask = make_batch(B, 6, seed=B, pad_rows=pad_rows)
    adapters = MIXED[:B]
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=10)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=10,
                         pad_token_id=PAD, eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)
    assert out.release_steps.tolist() == [-1] * B


def test_tied_embeddings_match_peft():
    model, oracle = build_pair("llama", tie_embeddings=True)
    ids, mask = make_batch(4, 5, seed=3, pad_rows=(1,))
    adapters = ["sql", "math", None, "med"]
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=8)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=8,
                         pad_token_id=PAD, eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_row_matches_peft_alone(arch):
    """Unpadded rows of a mixed batch equal PEFT generating that row alone with its adapter."""
    model, oracle = build_pair(arch)
    ids, mask = make_batch(5, 6, seed=11)
    adapters = ["med", "math", None, "sql", "math"]
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=9,
                         pad_token_id=PAD, eos_token_id=EOS)
    for i, a in enumerate(adapters):
        with torch.no_grad():
            if a is None:
                with oracle.disable_adapter():
                    ref = oracle.generate(input_ids=ids[i : i + 1], max_new_tokens=9, do_sample=False,
                                          pad_token_id=PAD, eos_token_id=EOS)
            else:
                oracle.set_adapter(a)
                ref = oracle.generate(input_ids=ids[i : i + 1], max_new_tokens=9, do_sample=False,
                                      pad_token_id=PAD, eos_token_id=EOS)
        assert torch.equal(out.sequences[i, : ref.shape[1]], ref[0]), f"row {i} ({a})"


def test_eos_stops_rows_and_pads_like_peft():
    model, oracle = build_pair("llama")
    ids, mask = make_batch(5, 6, seed=4, pad_rows=(2,))
    adapters = ["math", "sql", None, "med", "math"]
    free = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=12,
                          pad_token_id=PAD, eos_token_id=EOS)
    # Make a token that row 0 emits at step 3 the EOS token: rows must stop there as in PEFT.
    eos = int(free.sequences[0, 6 + 3])
    with torch.no_grad():
        ref = oracle.generate(input_ids=ids, attention_mask=mask, adapter_names=peft_names(adapters),
                              max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=12,
                         pad_token_id=PAD, eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    assert out.sequences[0, 6 + 4 :].eq(PAD).all()


def test_min_new_tokens_and_repetition_penalty_match_peft():
    model, oracle = build_pair("qwen2")
    ids, mask = make_batch(3, 5, seed=8, pad_rows=(1,))
    adapters = ["med", "sql", "math"]
    gen = dict(max_new_tokens=8, min_new_tokens=5, repetition_penalty=1.3)
    ref = peft_generate(oracle, ids, mask, adapters, **gen)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, pad_token_id=PAD, eos_token_id=EOS, **gen)
    assert torch.equal(out.sequences, ref)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model, _ = build_pair("llama")
    ids, mask = make_batch(4, 5, seed=2)
    adapters = ["math", None, "sql", "med"]
    kw = dict(attention_mask=mask, adapter_ids=adapters, max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS)
    a = model.generate(
        ids, do_sample=True, temperature=0.9, top_p=0.9, generator=torch.Generator(device=DEVICE).manual_seed(5), **kw
    )
    b = model.generate(
        ids, do_sample=True, temperature=0.9, top_p=0.9, generator=torch.Generator(device=DEVICE).manual_seed(5), **kw
    )
    assert torch.equal(a.sequences, b.sequences)
    greedy = model.generate(ids, **kw)
    top1 = model.generate(ids, do_sample=True, top_k=1, generator=torch.Generator(device=DEVICE).manual_seed(1), **kw)
    assert torch.equal(greedy.sequences, top1.sequences)


@pytest.mark.parametrize("grid", ["exact", "two_class"])
def test_triton_backend_matches_peft(grid, monkeypatch):
    """The Triton kernels (LoRA and decode attention; interpreter on CPU) inside the model give PEFT's tokens."""
    import lorazor.runner.attention as attention_module

    calls = []
    kernel = attention_module.decode_attention
    monkeypatch.setattr(attention_module, "decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    assert_model_gives_peft_tokens(LoRazorConfig(backend="triton", grid=grid, attention="triton", cuda_graphs=False))
    # 4 decode steps x 2 layers went through the decode-attention kernel (the kwarg reached it).
    assert len(calls) == 8


def test_generation_config_object_and_kwargs():
    from transformers import GenerationConfig

    model, oracle = build_pair("mistral")
    ids, mask = make_batch(3, 4, seed=9)
    adapters = ["sql", "math", None]
    cfg = GenerationConfig(max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS, do_sample=False)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, generation_config=cfg)
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=6)
    assert torch.equal(out.sequences, ref)
    shorter = model.generate(ids, attention_mask=mask, adapter_ids=adapters, generation_config=cfg, max_new_tokens=3)
    assert torch.equal(shorter.sequences, ref[:, : 4 + 3])


def test_unpatch_restores_peft_layers():
    model, oracle = build_pair("llama")
    ids, mask = make_batch(2, 4, seed=1)
    peft_model = model.unpatch()
    with torch.no_grad():
        a = peft_model(input_ids=ids, attention_mask=mask, adapter_names=["math", "sql"]).logits
        b = oracle(input_ids=ids, attention_mask=mask, adapter_names=["math", "sql"]).logits
    torch.testing.assert_close(a, b)


def test_max_new_tokens_zero_returns_prompt():
    model, _ = build_pair("llama")
    ids, mask = make_batch(2, 4, seed=1)
    out = model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=0)
    assert torch.equal(out.sequences, ids)


def test_different_alphas_ranks_and_targets_per_adapter():
    specs = (
        AdapterSpec("t1", 2, 32, ("q_proj",)),
        AdapterSpec("t2", 12, 3, ("down_proj", "up_proj")),
        AdapterSpec("t3", 5, 7, ("k_proj", "o_proj", "gate_proj"), rslora=True),
        AdapterSpec("t4", 1, 1, ("v_proj",)),
    )
    model, oracle = build_pair("qwen2", adapters=specs)
    ids, mask = make_batch(6, 5, seed=12, pad_rows=(0, 5))
    adapters = ["t4", "t1", None, "t3", "t2", "t1"]
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=7)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=7,
                         pad_token_id=PAD, eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)
