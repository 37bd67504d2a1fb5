"""fp8 base weights (`LoRazorConfig(quantization="fp8")`): stored as float8 with per-channel scales,
equal to PEFT run on the same dequantized weights, close to the unquantized model, the adapters'
effect kept, the engine equal to static generate, and the `_scaled_mm` GEMM equal to its definition."""

import copy

import pytest
import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_names
from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
from lorazor.tiny import tiny_peft_model
from lorazor_kernels import dequantize, fp8_linear, fp8_linear_reference, quantize_rows
from torch import nn

ADAPTERS = ["math", "sql", None, "med", "math"]


@pytest.fixture(scope="module")
def pair():
    """(fp8 LoRazorModel, PEFT oracle with the unquantized weights)."""
    return build_pair("llama", LoRazorConfig(quantization="fp8", cuda_graphs=False))


def dequantized_oracle(oracle):
    """A copy of the PEFT oracle whose decoder projections hold the weights the fp8 model computes
    with (the same per-channel quantization, dequantized)."""
    oracle = copy.deepcopy(oracle)
    decoder = oracle.get_base_model().get_decoder()
    for name, module in decoder.named_modules():
        # The base linears only: PEFT's own lora_A / lora_B linears are the adapters, kept as they are.
        if isinstance(module, nn.Linear) and ".lora_" not in name:
            weight, scale = quantize_rows(module.weight)
            module.weight.data = dequantize(weight, scale, module.weight.dtype)
    return oracle


def logits(model, oracle, ids, mask):
    ours = model(ids, attention_mask=mask, adapter_ids=ADAPTERS)
    with torch.no_grad():
        theirs = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(ADAPTERS)).logits
    return ours, theirs


def test_projections_are_stored_in_fp8_at_a_quarter_of_fp32():
    from lorazor.quant import Fp8Linear

    peft_model = tiny_peft_model("llama")
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(quantization="fp8"))
    layers = [m for m in model.model.get_decoder().modules() if isinstance(m, Fp8Linear)]
    full = sum(m.weight.numel() * 4 for m in layers)  # the same projections in fp32
    assert len(layers) == 2 * 7  # every projection of both layers, adapted or not
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32 for m in layers)
    stored = sum(m.weight.nbytes + m.weight_scale.nbytes for m in layers)
    assert 0.25 <= stored / full < 0.27, stored / full  # a quarter, plus one fp32 scale per row
    assert not any(isinstance(m, nn.Linear) for m in model.model.get_decoder().modules())  # none left behind
    assert model.model.get_output_embeddings().weight.dtype == torch.float32  # the LM head keeps its dtype
    with pytest.raises(RuntimeError, match="cannot be unpatched"):
        model.unpatch()


def test_equal_to_peft_on_the_dequantized_weights_and_close_to_the_original(pair):
    model, oracle = pair
    ids, mask = make_batch(len(ADAPTERS), 9, seed=3, pad_rows=(2,))
    ours, same = logits(model, dequantized_oracle(oracle), ids, mask)
    torch.testing.assert_close(ours, same, atol=1e-4, rtol=1e-4)  # the same weights: the same function
    _, original = logits(model, oracle, ids, mask)
    error = ((ours - original).norm() / original.norm()).item()
    assert 1e-4 < error < 5e-2, error  # what a per-channel fp8 round trip of the weights costs


def test_the_adapters_effect_is_kept(pair):
    """Each adapter moves the logits as much in fp8 as it does unquantized."""
    model, oracle = pair
    ids, mask = make_batch(1, 7, seed=4)
    base = model(ids, attention_mask=mask, adapter_ids=[None])
    with torch.no_grad():
        base_ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=["__base__"]).logits
    for name in ("math", "sql", "med"):
        delta = model(ids, attention_mask=mask, adapter_ids=[name]) - base
        with torch.no_grad():
            delta_ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=[name]).logits - base_ref
        assert delta.norm() > 0.1 * base.norm() or delta_ref.norm() < 1e-3  # a visible effect ...
        assert ((delta - delta_ref).norm() / delta_ref.norm()).item() < 0.1, name  # ... the same one


def test_greedy_generate_equals_peft_on_the_dequantized_weights(pair):
    model, oracle = pair
    ids, mask = make_batch(len(ADAPTERS), 6, seed=5, pad_rows=(1, 3))
    out = model.generate(ids, attention_mask=mask, adapter_ids=ADAPTERS, max_new_tokens=8, do_sample=False,
                         pad_token_id=PAD, eos_token_id=EOS)
    with torch.no_grad():
        ref = dequantized_oracle(oracle).generate(input_ids=ids, attention_mask=mask,
                                                  adapter_names=peft_names(ADAPTERS), max_new_tokens=8,
                                                  do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)


def test_the_engine_equals_static_generate_in_fp8(pair):
    model, _ = pair
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 96, (4 + i,), generator=g).tolist() for i in range(len(ADAPTERS))]
    engine = LoRazorEngine(model, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64, block_size=4)
    outs = engine.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                 eos_token_id=None, release=2) for p, a in zip(prompts, ADAPTERS)])
    for p, a, o in zip(prompts, ADAPTERS, outs):
        ref = model.generate(torch.tensor([p]), adapter_ids=[a], max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None, release=[2])
        assert o.token_ids == ref.sequences[0, len(p):].tolist(), a


@pytest.mark.parametrize("M, K, N", [(1, 64, 32), (5, 96, 48), (33, 128, 80)])
def test_the_scaled_mm_gemm_equals_its_definition(M, K, N):
    """The GPU path (per-token activation scales, `torch._scaled_mm`), run here on the CPU: within
    what rounding the activations to fp8 costs."""
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    weight, scale = quantize_rows(w)
    ref = fp8_linear_reference(x, weight, scale, b)
    got = fp8_linear(x, weight, scale, b, scaled=True)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    assert torch.equal(fp8_linear(x, weight, scale, b, scaled=False), ref)
    zero = quantize_rows(torch.zeros(N, K))
    assert torch.equal(fp8_linear_reference(x, *zero), torch.zeros(M, N))  # no division by zero


def test_unknown_quantizations_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"quantization must be one of \('fp8',\) or None, got 'int4'"):
        LoRazorConfig(quantization="int4")
