"""fp8 base weights (`LoRazorConfig(quantization="fp8")`): stored as float8 with per-channel scales,
equal to PEFT run on the same dequantized weights, close to the unquantized model, the adapters'
effect kept, the engine equal to static generate, and the `_scaled_mm` GEMM equal to its definition."""

import copy
import json
import re

import pytest
import torch
from conftest import DEVICE
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
        ref = model.generate(torch.tensor([p], device=DEVICE), adapter_ids=[a], max_new_tokens=6, do_sample=False,
                             pad_token_id=PAD,
                             eos_token_id=None, release=[2])
        assert o.token_ids == ref.sequences[0, len(p):].tolist(), a


@pytest.mark.parametrize("M, K, N", [(1, 64, 32), (5, 96, 48), (33, 128, 80)])
def test_the_scaled_mm_gemm_equals_its_definition(M, K, N):
    """The GPU path (per-token activation scales, `torch._scaled_mm`; bf16 on the GPU, fp32 on the
    CPU, where torch 2.13 runs it): within what rounding the activations to fp8 costs."""
    if DEVICE.type == "cuda" and (K % 16 or N % 16):
        pytest.skip("the GPU's _scaled_mm takes dims in multiples of 16 (fp8_linear falls back there)")
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    if DEVICE.type == "cpu" and not cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    g = torch.Generator().manual_seed(M)
    x, w, b = (torch.randn(*shape, generator=g).to(DEVICE, dtype) for shape in ((M, K), (N, K), (N,)))
    weight, scale = quantize_rows(w)
    ref = fp8_linear_reference(x, weight, scale, b)
    got = fp8_linear(x, weight, scale, b, scaled=True)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert ((got - ref).float().norm() / ref.float().norm()).item() < 0.05
    assert torch.equal(fp8_linear(x, weight, scale, b, scaled=False), ref)
    zero = quantize_rows(torch.zeros(N, K, device=DEVICE))
    assert torch.equal(fp8_linear_reference(x, *zero), x.new_zeros(M, N))  # no division by zero


def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row (2.13 does; 2.11 only per tensor)."""
    x = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def test_unknown_quantizations_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"quantization must be one of \('fp8',\) or None, got 'int4'"):
        LoRazorConfig(quantization="int4")


@pytest.mark.gpu
@pytest.mark.parametrize("M, K", [(1, 64), (5, 96), (17, 4100), (33, 8192)])
def test_gpu_token_quantization_kernel_equals_its_reference(M, K):
    from lorazor_kernels.fp8 import quantize_tokens, quantize_tokens_reference

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :7] = 0  # a row with zeros, and (below) one of all zeros
    x[-1] = 0
    rows = M + (-M % 16)
    got, ref = quantize_tokens(x, rows), quantize_tokens_reference(x, rows)
    assert got[0].shape == (rows, K) and got[1].shape == (rows, 1)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))  # the same fp8 bits


# A CPU run of the weight-only kernel in Triton's interpreter (TRITON_INTERPRET is read when a kernel is
# defined, hence a fresh process). The interpreter computes bf16 loads wrongly (also for kernels
# without split K), so it runs in fp16; the GPU test below covers bf16.
INTERPRETED_WEIGHT_ONLY = """
import json, sys, torch
from lorazor_kernels.fp8 import _COUNTERS, fp8_weight_only, quantize_rows
out = []
for M, K, N, split, bias in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g).half()
    weight, scale = quantize_rows(torch.randn(N, K, generator=g))
    b = torch.randn(N, generator=g).half() if bias else None
    launch = (32, 128, 4, 3, split)
    y = fp8_weight_only(x, weight, scale, b, launch=launch)
    exact = x.double() @ (weight.double() * scale.double()[:, None]).T + (b.double() if bias else 0)
    out.append(dict(error=((y.double() - exact).norm() / exact.norm()).item(),
                    same_again=torch.equal(fp8_weight_only(x, weight, scale, b, launch=launch), y),
                    # The interpreter sums a 1-row and a 16-row block in different orders: equal to
                    # rounding here; bit for bit only compiled (the GPU test).
                    row_alone=((fp8_weight_only(x[-1:], weight, scale, b, launch=launch)[0].double() - y[-1].double())
                               .abs().max() / y[-1].double().abs().max().clamp_min(1e-6)).item() < 2e-3,
                    counters=int(sum(c.abs().sum() for c in _COUNTERS.values()))))
print(json.dumps(out))
"""


def test_weight_only_launch_refuses_a_bad_split_naming_it():
    from lorazor_kernels.fp8 import fp8_weight_only

    weight, scale = quantize_rows(torch.randn(40, 64))
    for launch in ((32, 128, 4, 3, -2), (32, 128, 4, 3, 2, 1)):
        with pytest.raises(ValueError, match=re.escape(str(launch))):
            fp8_weight_only(torch.randn(2, 64), weight, scale, launch=launch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU test below runs the compiled kernel (and "
                    "Triton 3.6's interpreter, the GPU image's, refuses the kernel's runtime loop bound)")
def test_weight_only_kernel_splits_k_and_equals_its_definition_in_the_interpreter(tmp_path):
    """Split K (narrow GEMMs spread over the whole GPU): each split's partial sums, added by the last
    program of a column block, equal the exact product; the result is the same on a second launch
    (the arrival counters are left zeroed) and for a row alone. Odd K, N and rows, splits of 1-4 and
    a tail split shorter than the others."""
    import subprocess
    import sys

    cases = [(1, 200, 70, 3, False), (5, 1000, 33, 2, True), (16, 512, 64, 4, False), (3, 300, 40, 1, True),
             (2, 700, 50, 0, False)]  # split 0: `_split_k` chooses (the CPU counts one multiprocessor: no split)
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED_WEIGHT_ONLY, json.dumps(cases)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for case, got in zip(cases, json.loads(done.stdout.splitlines()[-1]), strict=True):
        assert got["error"] < 1e-3 and got["same_again"] and got["row_alone"] and got["counters"] == 0, (case, got)


INTERPRETED_BLOCK_SCALED = """
import json, sys, torch
from lorazor_kernels.fp8 import _COUNTERS, dequantize, fp8_linear, fp8_weight_only
out = []
for M, K, N, split, bias in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g).half()
    weight = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # past 448: NaN
    scale = torch.rand(-(-N // 128), -(-K // 128), generator=g) + 0.01  # blocks of very different scales
    b = torch.randn(N, generator=g).half() if bias else None
    launch = None if split is None else (32, 256, 4, 3, split)  # BLOCK_K 256: cut to the 128 of a block
    y = fp8_weight_only(x, weight, scale, b, launch=launch)
    exact = x.double() @ dequantize(weight, scale, torch.float64).T + (b.double() if bias else 0)
    reference = fp8_linear(x.float(), weight, scale, None if b is None else b.float())  # the CPU's path
    out.append(dict(error=((y.double() - exact).norm() / exact.norm()).item(),
                    reference_error=((reference.double() - exact).norm() / exact.norm()).item(),
                    counters=int(sum(c.abs().sum() for c in _COUNTERS.values()))))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the GPU test below runs the compiled kernel")
def test_block_scaled_weight_only_kernel_equals_its_definition_in_the_interpreter():
    """An fp8 checkpoint's 128x128 block scales kept in the GEMM: a few rows with split K (splits
    that do not end on a block edge), and more rows than `WEIGHT_ONLY_ROWS` in row blocks; odd
    sizes with partial blocks; the CPU's path (dequantized blocks) equal to the definition too."""
    import subprocess
    import sys

    cases = [(1, 300, 200, 3, False), (5, 1000, 130, 2, True), (16, 256, 129, 1, False), (40, 300, 200, None, True),
             (70, 129, 257, None, False)]
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED_BLOCK_SCALED, json.dumps(cases)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for case, got in zip(cases, json.loads(done.stdout.splitlines()[-1]), strict=True):
        assert got["error"] < 1e-3 and got["reference_error"] < 1e-6 and got["counters"] == 0, (case, got)


def test_fp8_pdl_setting_reaches_the_weight_only_launch(tmp_path, monkeypatch):
    # `KernelConfig.fp8_pdl` decides the weight-only kernel's programmatic dependent launch (`pdl` the LoRA
    # kernels'); the result is the definition's either way (the interpreter runs no PDL).
    from helpers import use_kernel_config
    from lorazor_kernels import fp8 as fp8_module

    asked = []
    real = fp8_module.pdl_launch
    monkeypatch.setattr(fp8_module, "pdl_launch", lambda on, device: asked.append(on) or real(on, device))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 96, generator=g).to(DEVICE), torch.randn(48, 96, generator=g).to(DEVICE)
    weight, scale = quantize_rows(w)
    exact = x.double() @ (weight.double() * scale.double()[:, None]).T
    for on in (True, False):
        (tmp_path / str(on)).mkdir()  # a file per setting: configs are cached by path
        use_kernel_config(tmp_path / str(on), monkeypatch, fp8_pdl=on, pdl=not on)
        got = fp8_module.fp8_weight_only(x, weight, scale)
        assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-5
    assert asked == [True, False]


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(5120, 3072), (3072, 8192)])
def test_gpu_weight_only_gemm_with_pdl_in_a_graph(N, K, tmp_path, monkeypatch):
    # With `fp8_pdl` the first weight tile is read before the wait for the kernel ahead, which here
    # writes x inside the same graph: the result must be of the x it wrote.
    from helpers import use_kernel_config
    from lorazor_kernels.fp8 import fp8_weight_only

    use_kernel_config(tmp_path, monkeypatch, fp8_pdl=True)
    g = torch.Generator().manual_seed(N)
    source = torch.randn(1, K, generator=g).bfloat16().cuda()
    weight, scale = quantize_rows(torch.randn(N, K, generator=g).cuda())
    x = source.clone()
    fp8_weight_only(x, weight, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(source * 2)
        y = fp8_weight_only(x, weight, scale)
    x.zero_()
    graph.replay()
    exact = (source * 2).double() @ (weight.double() * scale.double()[:, None]).T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("M, K, N, bias, split", [(1, 2048, 512, False, 0), (7, 3072, 1000, True, 0),
                                                  (256, 2048, 640, False, None), (33, 4100, 300, True, None)])
def test_gpu_block_scaled_gemm_equals_its_definition(M, K, N, bias, split):
    from lorazor_kernels.fp8 import dequantize, fp8_linear

    g = torch.Generator().manual_seed(M + K)
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    weight = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()  # past 448: NaN
    scale = (torch.rand(-(-N // 128), -(-K // 128), generator=g) + 0.01).cuda()
    b = torch.randn(N, generator=g).bfloat16().cuda() if bias else None
    got = fp8_linear(x, weight, scale, b)
    exact = x.double() @ dequantize(weight, scale, torch.float64).T + (b.double() if bias else 0)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 5e-3  # bf16 output rounding


@pytest.mark.gpu
@pytest.mark.parametrize("M, K, N, bias, dtype, split", [
    (1, 64, 32, False, torch.bfloat16, None), (5, 96, 48, True, torch.bfloat16, None),
    (16, 3072, 5120, False, torch.bfloat16, None), (7, 200, 33, True, torch.float16, None),
    (1, 3072, 3072, False, torch.bfloat16, None), (3, 8192, 3072, True, torch.bfloat16, 7),
    (9, 1000, 200, False, torch.float16, 2)])
def test_gpu_weight_only_gemm_equals_its_definition_row_by_row(M, K, N, bias, dtype, split):
    """A few rows (decode at small batch): the fp8 weights widened in registers, x unquantized, fp32
    sums and the scale in the epilogue; closer to the exact product than the bf16 reference (which
    rounds the dequantized weights), and each row's result independent of the other rows. Narrow
    GEMMs (o: 3,072 channels) split K by default; `split` forces a split count."""
    from lorazor_kernels.fp8 import _COUNTERS, WEIGHT_ONLY_ROWS, fp8_weight_only

    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to("cuda", dtype)
    w, b = torch.randn(N, K, generator=g).cuda(), torch.randn(N, generator=g).to("cuda", dtype) if bias else None
    weight, scale = quantize_rows(w)
    launch = None if split is None else (32, 128, 4, 3, split)
    got = fp8_weight_only(x, weight, scale, b, launch=launch)
    exact = x.double() @ (weight.double() * scale.double()[:, None]).T + (b.double() if bias else 0)
    error = lambda y: ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert got.dtype == dtype and got.shape == (M, N)
    assert error(got) < 4e-3 and error(got) <= error(fp8_linear_reference(x, weight, scale, b)) * 1.05
    if split is None:
        assert torch.equal(fp8_linear(x, weight, scale, b), got)  # the path fp8_linear takes for few rows
    assert torch.equal(fp8_weight_only(x[M // 2:M // 2 + 1], weight, scale, b, launch=launch)[0], got[M // 2])
    for _ in range(3):  # launches back to back: each finds its arrival counters zeroed by the last
        assert torch.equal(fp8_weight_only(x, weight, scale, b, launch=launch), got)
    assert all(not c.any() for c in _COUNTERS.values())
    with pytest.raises(ValueError, match=f"at most {WEIGHT_ONLY_ROWS} rows, got {WEIGHT_ONLY_ROWS + 1}"):
        fp8_weight_only(x.new_zeros(WEIGHT_ONLY_ROWS + 1, K), weight, scale)


@pytest.mark.gpu
def test_gpu_bf16_fp8_model_agrees_with_its_dequantized_bf16_reference():
    # bf16 activations over fp8 weights through `_scaled_mm` (activations rounded to fp8 per token)
    # against PEFT on the dequantized weights in bf16, in graphs and in the engine.
    model, oracle = build_pair("llama", LoRazorConfig(quantization="fp8"), dtype=torch.bfloat16)
    reference = dequantized_oracle(oracle)
    ids, mask = make_batch(len(ADAPTERS), 9, seed=3, pad_rows=(2,))
    ours, theirs = logits(model, reference, ids, mask)
    error = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
    # Activations rounded to fp8 (3 mantissa bits) before each of a layer's GEMMs: each rounds by ~2.5%
    # (rms), which compounds through the random tiny model to ~15% of its logits (measured on an H100:
    # 0.147). The trained testbed's accuracy in fp8 is the end-to-end bar (the slow test below).
    assert error < 0.25, error
    engine = LoRazorEngine(model, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(len(ADAPTERS))]
    outs = engine.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=1, do_sample=False, pad_token_id=PAD,
                                 eos_token_id=None) for p, a in zip(prompts, ADAPTERS)])
    first = theirs[:, -1].argmax(-1).tolist()
    agree = sum(o.token_ids[0] == t for o, t in zip(outs, first))
    assert agree >= len(ADAPTERS) - 1, (agree, [o.token_ids for o in outs], first)  # near-ties may flip one


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_testbed_adapters_keep_their_accuracy_in_fp8():
    from lorazor.testbed import load
    from lorazor.testbed.evaluate import run_task

    accuracy = {}
    for quantization in (None, "fp8"):
        peft_model, tokenizer, tasks = load()
        model = LoRazorModel.from_peft(peft_model.to("cuda", torch.bfloat16),
                                       LoRazorConfig(quantization=quantization))
        accuracy[quantization] = {n: run_task(model, tokenizer, t, n, "full", limit=100)[0] for n, t in tasks.items()}
    for name, bf16 in accuracy[None].items():
        assert accuracy["fp8"][name] >= bf16 - 0.05, (name, accuracy)  # within 5 points per task


BLOCK = (32, 32)  # a 112-wide MLP has a partial block, as real checkpoints' odd sizes do


def write_block_fp8_checkpoint(folder, model, block=BLOCK):
    """Save `model` in the Hugging Face fp8 format (transformers' FineGrainedFP8): each decoder
    projection's weight in float8_e4m3fn with a float32 `weight_scale_inv` per `block`; returns the
    block-dequantized weights, module name -> tensor (what the checkpoint means)."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    meant = {}
    for key in list(tensors):
        if not (key.startswith("model.layers.") and key.endswith("_proj.weight")):
            continue
        w = tensors[key].float()
        n, k = w.shape
        scale = torch.empty(-(-n // block[0]), -(-k // block[1]))
        w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                scale[i, j] = w[rows, cols].abs().max().clamp(min=1e-12) / 448.0
                w8[rows, cols] = (w[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
        tensors[key], tensors[key.replace(".weight", ".weight_scale_inv")] = w8, scale
        expand = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        meant[key[: -len(".weight")]] = w8.float() * expand
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    return meant


def checkpoint_with_adapters(root, block=BLOCK, **sizes):
    """(checkpoint folder, adapter folders, PEFT oracle over the unquantized base, block-dequantized weights)."""
    from lorazor.tiny import tiny_config
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama")
    for key, value in sizes.items():
        setattr(config, key, value)
    base = AutoModelForCausalLM.from_config(config).eval()
    meant = write_block_fp8_checkpoint(root / "base", copy.deepcopy(base), block)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    oracle = None
    for name, r in (("math", 8), ("sql", 4)):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=every, init_lora_weights=False)
        oracle = get_peft_model(base, cfg, adapter_name=name) if oracle is None else oracle
        if name != "math":
            oracle.add_adapter(name, cfg)
        oracle.save_pretrained(root / "adapters", selected_adapters=[name])
    return root / "base", {n: root / "adapters" / n for n in ("math", "sql")}, oracle.eval(), meant


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return checkpoint_with_adapters(tmp_path_factory.mktemp("fp8"))


@pytest.fixture(scope="module")
def fp8_checkpoint_128(tmp_path_factory):
    """A checkpoint in the published format's 128x128 blocks, sized so its projections have several
    blocks, partial ones among them: q/k/v 256/128/128 x 256 (merged into one GEMM, their block rows
    concatenated), gate/up 320 x 256 (partial blocks, not merged), down 256 x 320."""
    return checkpoint_with_adapters(tmp_path_factory.mktemp("fp8_128"), (128, 128), hidden_size=256,
                                    intermediate_size=320, head_dim=64)


def oracle_logits(oracle, weights, ids, mask, rows):
    """PEFT's logits with its base projections holding `weights` (module name -> tensor)."""
    copied = copy.deepcopy(oracle)
    replaced = 0
    for name, module in copied.get_base_model().named_modules():
        name = name.replace(".base_layer", "")  # PEFT's wrapped linear, under the projection's name
        if isinstance(module, nn.Linear) and name in weights:
            module.weight.data = weights[name].to(module.weight.device, module.weight.dtype)
            replaced += 1
    assert replaced == len(weights) == 2 * 7
    with torch.no_grad():
        return copied(input_ids=ids, attention_mask=mask, adapter_names=peft_names(rows)).logits


def test_a_128_block_fp8_checkpoint_keeps_its_blocks_and_equals_peft_on_its_weights(fp8_checkpoint_128):
    # The published format's blocks are kept: the fp8 bytes and scales are the checkpoint's, and the
    # model computes exactly what the checkpoint means (fp32, CPU).
    from lorazor.quant import Fp8Linear
    from safetensors.torch import load_file

    folder, adapters, oracle, meant = fp8_checkpoint_128
    model = LoRazorModel.from_pretrained(folder, adapters=adapters, config=LoRazorConfig(dtype="float32"))
    stored = load_file(str(folder / "model.safetensors"))
    layers = {name.replace(".base_layer", ""): m for name, m in model.model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 2 * 7
    for name, layer in layers.items():
        assert layer.weight_scale.dim() == 2 and torch.equal(layer.weight_scale, stored[name + ".weight_scale_inv"])
        assert torch.equal(layer.weight.view(torch.uint8), stored[name + ".weight"].view(torch.uint8))
        assert "128x128 block scales" in repr(layer)
    assert any(layer.weight_scale.shape[0] > 1 and layer.weight_scale.shape[1] > 1 for layer in layers.values())
    merged = {tuple(m.base_layer.out_features for m in g.members) for g in model.merged_groups}
    assert merged == {(256, 128, 128)}, merged  # q/k/v merged; gate/up (320: partial blocks) not
    rows = ["math", None, "sql"]
    ids, mask = (t.cpu() for t in make_batch(len(rows), 8, seed=11, pad_rows=(1,)))
    ours = model(ids, attention_mask=mask, adapter_ids=rows)
    theirs = oracle_logits(oracle, meant, ids, mask, rows)
    error = ((ours[:, -1] - theirs[:, -1]).norm() / theirs[:, -1].norm()).item()
    assert error < 2e-3, error  # the bar; in fp32 it is rounding only (~1e-7)
    out = model.generate(ids, attention_mask=mask, adapter_ids=rows, max_new_tokens=4, do_sample=False,
                         pad_token_id=PAD, eos_token_id=None)
    assert out.sequences.shape == (3, ids.shape[1] + 4)


@pytest.mark.gpu
def test_gpu_128_block_fp8_checkpoint_agrees_with_peft_on_its_weights_in_bf16(fp8_checkpoint_128):
    # bf16 activations over the kept blocks (the weight-only kernel at every row count) against PEFT in
    # bf16 on the checkpoint's dequantized weights, in generate()'s forward and in the engine.
    folder, adapters, oracle, meant = fp8_checkpoint_128
    model = LoRazorModel.from_pretrained(folder, adapters=adapters, config=LoRazorConfig(dtype="bfloat16"),
                                         device_map="cuda")
    rows = ["math", None, "sql"]
    ids, mask = (t.cuda() for t in make_batch(len(rows), 40, seed=11, pad_rows=(1,)))  # 120 rows: row blocks
    ours = model(ids, attention_mask=mask, adapter_ids=rows).float()
    theirs = oracle_logits(copy.deepcopy(oracle).to("cuda", torch.bfloat16), meant, ids, mask, rows).float()
    error = ((ours[:, -1] - theirs[:, -1]).norm() / theirs[:, -1].norm()).item()
    assert error < 2e-2, error  # bf16 agreement through two layers
    engine = LoRazorEngine(model, max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=64)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(len(rows))]
    outs = engine.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=1, do_sample=False, eos_token_id=None)
                            for p, a in zip(prompts, rows)])
    first = theirs[:, -1].argmax(-1).tolist()
    assert sum(o.token_ids[0] == t for o, t in zip(outs, first)) >= len(rows) - 1


def test_a_block_fp8_checkpoint_loads_in_fp8_and_equals_peft_on_its_weights(fp8_checkpoint):
    from lorazor.quant import Fp8Linear

    folder, adapters, oracle, meant = fp8_checkpoint
    model = LoRazorModel.from_pretrained(folder, adapters=adapters, config=LoRazorConfig(dtype="float32"))
    assert model.config.quantization == "fp8"
    layers = {name: m for name, m in model.model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 2 * 7 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers.values())
    rows = ["math", None, "sql"]
    ids, mask = (t.cpu() for t in make_batch(len(rows), 8, seed=11, pad_rows=(1,)))  # from_pretrained: the CPU
    ours = model(ids, attention_mask=mask, adapter_ids=rows)

    def oracle_on(weights):
        copied = copy.deepcopy(oracle)
        replaced = 0
        for name, module in copied.get_base_model().named_modules():
            name = name.replace(".base_layer", "")  # PEFT's wrapped linear, under the projection's name
            if isinstance(module, nn.Linear) and name in weights:
                module.weight.data = weights[name].to(module.weight.dtype)
                replaced += 1
        assert replaced == len(weights) == 2 * 7
        with torch.no_grad():
            return copied(input_ids=ids, attention_mask=mask, adapter_names=peft_names(rows)).logits

    # PEFT on the weights the model computes with: the same function.
    ours_weights = {name.replace(".base_layer", ""): m.dequantized(torch.float32) for name, m in layers.items()}
    torch.testing.assert_close(ours, oracle_on(ours_weights), atol=1e-4, rtol=1e-4)
    # PEFT on the checkpoint's own block-dequantized weights: within one more fp8 rounding of some blocks.
    theirs = oracle_on({name: w for name, w in meant.items()})
    error = ((ours - theirs).norm() / theirs.norm()).item()
    assert error < 3e-2, error
    # Each row keeps the values of its largest-scale block exactly (which may be the narrow last one).
    for name, w in meant.items():
        kept = (ours_weights[name] == w).sum(1)
        assert kept.min() >= min(BLOCK[1], w.shape[1] % BLOCK[1] or BLOCK[1]), (name, kept)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method is 'awq'; LoRazor loads \('fp8',\) checkpoints"),
    ({"quant_method": "fp8"}, "needs quantization_config.weight_block_size"),
])
def test_other_checkpoint_quantizations_are_refused_naming_the_supported_one(fp8_checkpoint, tmp_path,
                                                                          quantization_config, message):
    import shutil

    folder = tmp_path / "base"
    shutil.copytree(fp8_checkpoint[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=message):
        LoRazorModel.from_pretrained(folder, adapters=fp8_checkpoint[1])


def test_compiled_backbone_only_steps_run_the_fp8_gemm_as_one_opaque_op():
    # A step with no LoRA row calls the fp8 GEMM outside the LoRA op: compiled, it must stay opaque
    # (traced, its Triton quantization kernel broke inductor on the GPU) and equal the eager step.
    from torch._dynamo.utils import counters

    counters.clear()
    model = build_pair("llama", LoRazorConfig(quantization="fp8", compile=True, cuda_graphs=False))[0]
    eager = build_pair("llama", LoRazorConfig(quantization="fp8", compile=False, cuda_graphs=False))[0]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 96, (5 + i,), generator=g).tolist() for i in range(3)]
    outs = []
    for m in (model, eager):
        engine = LoRazorEngine(m, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, block_size=4)
        done = engine.generate([dict(prompt_ids=p, adapter=None, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                                     eos_token_id=None) for p in prompts])
        assert all(o.finish_reason == "length" for o in done), [o.finish_reason for o in done]
        outs.append([o.token_ids for o in done])
    assert outs[0] == outs[1]
    assert dict(counters["graph_break"]) == {}


def test_block_scales_of_the_wrong_shape_are_refused_naming_it():
    from lorazor.quant import Fp8Linear

    weight = torch.zeros(300, 200, dtype=torch.float8_e4m3fn)
    Fp8Linear(weight, torch.ones(3, 2), None)  # ceil(300 / 128) x ceil(200 / 128)
    with pytest.raises(ValueError, match=r"block scales of shape \(2, 2\) for a 300x200 fp8 weight.*expected \(3, 2\)"):
        Fp8Linear(weight, torch.ones(2, 2), None)
