"""Every supported decoder family equals PEFT on a tiny config: logits of a mixed-adapter batch,
greedy tokens of `generate()`, and the engine's tokens; an unsupported one is refused from its
config.json before any weight is read."""

import copy
import json

import pytest
import torch
from helpers import EOS, PAD, make_batch, peft_generate, peft_names
from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
from lorazor.tiny import tiny_peft_model

FAMILIES = ["qwen3", "gemma", "gemma2", "gemma3", "phi3"]
ADAPTERS = ["math", "sql", None, "med"]


def pair(arch):
    peft_model = tiny_peft_model(arch)
    oracle = copy.deepcopy(peft_model)
    return LoRazorModel.from_peft(peft_model, LoRazorConfig()), oracle


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_equals_peft(arch):
    model, oracle = pair(arch)
    ids, mask = make_batch(len(ADAPTERS), 9, seed=3, pad_rows=(1, 2))
    ids, mask = ids.cpu(), mask.cpu()
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(ADAPTERS)).logits
    got = model(ids, attention_mask=mask, adapter_ids=ADAPTERS)
    real = mask.bool()
    assert torch.allclose(got[real], ref[real], atol=1e-5, rtol=1e-4), (got[real] - ref[real]).abs().max()
    out = model.generate(ids, attention_mask=mask, adapter_ids=ADAPTERS, max_new_tokens=8, pad_token_id=PAD,
                         eos_token_id=EOS, do_sample=False)
    expected = peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=8)
    assert torch.equal(out.sequences, expected)


def engine_outputs(model):
    """Four prompts of mixed lengths (one chunked) with ADAPTERS through the engine: (prompts, outputs)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in (5, 11, 3, 8)]
    engine = LoRazorEngine(model, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=32, block_size=4)
    return prompts, engine.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=6, pad_token_id=PAD,
                                          eos_token_id=EOS) for p, a in zip(prompts, ADAPTERS)])


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "gemma2"])
def test_family_in_the_engine_equals_generate(arch):
    model, _ = pair(arch)
    prompts, outs = engine_outputs(model)
    for p, a, o in zip(prompts, ADAPTERS, outs):
        ref = model.generate(torch.tensor([p]), adapter_ids=[a], max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS,
                             do_sample=False)
        assert o.token_ids == ref.sequences[0, len(p):].tolist(), a


def test_softcaps_change_a_tiny_gemma2_and_the_engine_refuses_it():
    # The tiny config's low caps must matter, or the parity above would not test them.
    model, oracle = pair("gemma2")
    ids, mask = make_batch(2, 6, seed=4)
    ids, mask = ids.cpu(), mask.cpu()
    config = oracle.get_base_model().config
    with torch.no_grad():
        capped = oracle(input_ids=ids, attention_mask=mask).logits
        config.attn_logit_softcapping = config.final_logit_softcapping = None
        uncapped = oracle(input_ids=ids, attention_mask=mask).logits
    assert (capped - uncapped).abs().max() > 1e-2
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping=2.0.*use LoRazorModel.generate"):
        LoRazorEngine(model, num_kv_blocks=8)


def test_unsupported_model_is_refused_from_config_before_any_weight(tmp_path):
    # A weight file that is not a weight file: reading it would fail with another error.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 96}))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(NotImplementedError, match=r"model_type 'gpt2' is not supported; supported: .*qwen3"):
        LoRazorModel.from_pretrained(tmp_path)


def test_serve_refuses_an_unsupported_model_in_one_line(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                      "vocab_size": 96}))
    done = subprocess.run([sys.executable, "-m", "lorazor", "serve", "--model", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lorazor serve: error: model_type 'gpt2' is not supported; supported: llama"), last
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("arch", FAMILIES)
def test_family_in_bf16_on_the_gpu_within_pefts_own_bf16_error(arch):
    """LoRazor in bf16 (Triton kernels, CUDA graphs) against PEFT in fp32, no further off than PEFT's
    own bf16 run is."""
    base = tiny_peft_model(arch)
    oracle32 = copy.deepcopy(base).cuda()
    oracle16 = copy.deepcopy(base).to(torch.bfloat16).cuda()
    model = LoRazorModel.from_peft(copy.deepcopy(base).to(torch.bfloat16).cuda(), LoRazorConfig())
    ids, mask = make_batch(len(ADAPTERS), 9, seed=3, pad_rows=(1, 2))
    ids, mask = ids.cuda(), mask.cuda()
    names = peft_names(ADAPTERS)
    with torch.no_grad():
        ref = oracle32(input_ids=ids, attention_mask=mask, adapter_names=names).logits.float()
        peft16 = oracle16(input_ids=ids, attention_mask=mask, adapter_names=names).logits.float()
    got = model(ids, attention_mask=mask, adapter_ids=ADAPTERS).float()
    real = mask.bool()
    peft_error = (peft16[real] - ref[real]).abs().max().item()
    ours = (got[real] - ref[real]).abs().max().item()
    assert ours <= 2 * peft_error + 1e-3, (ours, peft_error)
    out = model.generate(ids, attention_mask=mask, adapter_ids=ADAPTERS, max_new_tokens=8, pad_token_id=PAD,
                         eos_token_id=EOS, do_sample=False)
    assert out.sequences.shape == (len(ADAPTERS), 17) and model.graphs is not None


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", *FAMILIES])
def test_family_compiled_equals_peft_without_graph_breaks(arch):
    # compile=True compiles one decoder layer (plus the final norm and the rotary embeddings) for all
    # layers: every family's layer must trace whole, and generate() and the engine must still equal PEFT.
    from torch._dynamo.utils import counters

    peft_model = tiny_peft_model(arch)
    oracle = copy.deepcopy(peft_model)
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(compile=True, cuda_graphs=False))
    counters.clear()
    ids, mask = make_batch(len(ADAPTERS), 9, seed=3, pad_rows=(1, 2))
    ids, mask = ids.cpu(), mask.cpu()
    out = model.generate(ids, attention_mask=mask, adapter_ids=ADAPTERS, max_new_tokens=6, pad_token_id=PAD,
                         eos_token_id=EOS, do_sample=False)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1  # the decode steps did compile
    if arch == "gemma2":  # the engine refuses softcapped attention (above)
        return
    prompts, outs = engine_outputs(model)
    for p, a, o in zip(prompts, ADAPTERS, outs):
        ref = peft_generate(oracle, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), [a], max_new_tokens=6)
        assert o.token_ids == ref[0, len(p):].tolist(), a
    assert dict(counters["graph_break"]) == {}
