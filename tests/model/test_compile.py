"""torch.compile of the decode step: no graph breaks, same tokens as PEFT."""

import pytest
import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_generate
from lorazor import LoRazorConfig


def test_compiled_decode_step_matches_peft():
    from torch._dynamo.utils import counters

    counters.clear()
    model, oracle = build_pair("qwen2", LoRazorConfig(compile=True, cuda_graphs=False))
    ids, mask = make_batch(4, 5, seed=7, pad_rows=(2,))
    adapters = ["med", None, "math", "sql"]
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=6)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)
    assert dict(counters["graph_break"]) == {}
    # The adapter mix changes between calls without a recompile.
    frames = counters["stats"]["unique_graphs"]
    model.generate(ids, attention_mask=mask, adapter_ids=["sql", "sql", None, "med"], max_new_tokens=6,
                   pad_token_id=PAD, eos_token_id=EOS)
    assert counters["stats"]["unique_graphs"] == frames


def test_one_compile_serves_every_slot_bound_class():
    from torch._dynamo.utils import counters

    from lorazor.tiny import AdapterSpec

    counters.clear()
    specs = tuple(AdapterSpec(f"a{i}", 4, 8, ("q_proj", "v_proj")) for i in range(20))
    model, oracle = build_pair("llama", LoRazorConfig(compile=True, cuda_graphs=False, backend="triton"),
                               adapters=specs)
    ids, mask = make_batch(24, 5, seed=8, pad_rows=(1,))
    few = [f"a{3 + i % 2}" for i in range(24)]
    many = [f"a{i % 20}" if i < 21 else None for i in range(24)]
    graphs = []
    for adapters in (few, many):
        out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=4, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, adapters, max_new_tokens=4))
        graphs.append(counters["stats"]["unique_graphs"])
    # Slot-bound classes 16 and 20 (tile tables of 2 + 16 and 2 + 20 tiles): the same compiled step.
    assert graphs[0] >= 1 and graphs[1] == graphs[0]
    assert dict(counters["graph_break"]) == {}


@pytest.mark.gpu
def test_gpu_compiled_graphs_match_fp32_peft_across_adapter_mixes():
    # The benchmarks' fastest setup (torch.compile inside the captured CUDA graphs, merged projections,
    # the Triton kernels) against PEFT, and again after the adapter mix changes (same graphs).
    from lorazor.tiny import AdapterSpec

    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    specs = (AdapterSpec("math", 8, 16, every), AdapterSpec("sql", 8, 8, every), AdapterSpec("med", 8, 4, every))
    model, oracle = build_pair("llama", LoRazorConfig(compile=True), adapters=specs)
    ids, mask = make_batch(16, 6, seed=9, pad_rows=(1, 7))
    captured = []
    for adapters in (["math", "sql", None, "med"] * 4, ["med"] * 5 + ["sql"] * 11):
        out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=10, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, adapters, max_new_tokens=10))
        captured.append(model.graphs.num_graphs())
    assert captured[0] >= 1 and captured[1] == captured[0]  # the new mix replays the graphs it found


def test_one_compiled_decoder_layer_serves_every_layer():
    # Regional compilation: an 8-layer model's steps compile the decoder layer twice in all (batch 1,
    # then a dynamic batch), not once per layer, and the engine's tokens still equal PEFT's. The layer
    # number is dynamic from the first compile: a compile specialized on layer 0 would make three.
    # The KV writes of all layers land in their own layer.
    from helpers import peft_names
    from lorazor import LoRazorEngine
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # count this model's compiles alone
    counters.clear()
    model, oracle = build_pair("llama", LoRazorConfig(compile=True, cuda_graphs=False), num_layers=8)
    assert len(model.runner.decoder.layers) == 8
    eng = LoRazorEngine(model, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 90, (3 + i,), generator=g).tolist() for i in range(5)]
    adapters = ["math", None, "sql", "med", "math"]
    ids, done = [], {}
    for p, a in zip(ps, adapters):  # staggered: decode batches of 1 to 5 rows
        ids.append(eng.add_request(p, adapter=a, max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS))
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    compiles = model.runner.compiled_layers.compiles()
    assert compiles["LlamaDecoderLayer"] <= 2, compiles
    assert dict(counters["graph_break"]) == {}
    for i, p, a in zip(ids, ps, adapters):
        with torch.no_grad():
            ref = oracle.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  adapter_names=peft_names([a]), max_new_tokens=6, do_sample=False,
                                  pad_token_id=PAD, eos_token_id=EOS)
        assert done[i].token_ids == ref[0, len(p):].tolist(), a
    layers = model.runner.decoder.layers
    assert all("forward" in layer.__dict__ for layer in layers)  # the compiled regions' entry points
    model.unpatch()
    assert not any("forward" in layer.__dict__ for layer in layers)  # the model is handed back as it was


def test_compile_counts_reach_a_region_whose_forward_a_torch_decorator_wraps():
    # Some transformers versions wrap a rotary embedding's forward in `@torch.no_grad()`; dynamo
    # files that region's compiles under its own wrapper's code, which `compiles()` must count.
    from lorazor.runner.compiled_layers import CompiledLayers

    class Layer(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    class NoGradRotaryEmbedding(torch.nn.Module):
        @torch.no_grad()
        def forward(self, x):
            return x.sin()

    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([Layer(4, 4) for _ in range(2)])
    decoder.rotary_emb = NoGradRotaryEmbedding()
    torch._dynamo.reset()
    regions = CompiledLayers(decoder)
    x = torch.randn(3, 4)
    assert regions.compiles() == {"Layer": 0, "NoGradRotaryEmbedding": 0}
    with regions.active():
        expected = x.sin()
        torch.testing.assert_close(decoder.rotary_emb(x), expected)
        decoder.layers[1](decoder.layers[0](x))
    compiles = regions.compiles()
    assert compiles["NoGradRotaryEmbedding"] == 1 and 1 <= compiles["Layer"] <= 2, compiles


def test_generate_compiles_a_few_times_for_every_batch_size_and_length():
    # generate()'s caches differ per call (batch size, prompt + max_new_tokens); the compiled layer's
    # batch and lengths are dynamic, so five different calls share a few compiles, not one each.
    torch._dynamo.reset()
    model, oracle = build_pair("llama", LoRazorConfig(compile=True, cuda_graphs=False))
    for b, t, n in [(3, 5, 4), (5, 7, 6), (9, 4, 10), (2, 12, 3), (16, 6, 5)]:
        ids, mask = make_batch(b, t, seed=b, pad_rows=(1,))
        adapters = (["math", None, "sql", "med"] * 4)[:b]
        out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=n, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, adapters, max_new_tokens=n))
    assert 1 <= model.runner.compiled_layers.compiles()["LlamaDecoderLayer"] <= 3


def test_compiled_kv_write_is_the_opaque_op_in_place_on_the_pool():
    # Inductor autotunes the kernels it generates and, while it benchmarks, saves and restores every
    # argument a kernel mutates: a generated scatter into the KV pool copied the whole pool (out of
    # memory at the default gpu_memory_utilization on the GPU). The write must reach the compiled
    # code as LoRazor's opaque op, on the pool itself (no functional copy of the pool anywhere).
    from torch._inductor.utils import run_and_get_code

    from lorazor.runner.layer_stack import LayerStack

    stack = LayerStack(3, (40, 2, 16), torch.float32, "cpu")
    expected = LayerStack(3, (40, 2, 16), torch.float32, "cpu")

    def step(target, layer, slots, keys):
        target.index_copy_(layer, slots, keys * 2)
        return target.layer(layer).sum(0) + 1

    slots, keys = torch.tensor([3, 7, 39]), torch.randn(3, 2, 16)
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(lambda *a: step(stack, *a)), 1, slots, keys)
    code = "\n".join(codes)
    assert torch.equal(out, step(expected, 1, slots, keys))
    assert torch.equal(stack.flat, expected.flat)  # layer 1's rows 3, 7, 39 written, nothing else
    assert "torch.ops.lorazor.write_pool.default(arg" in code, code
    body = code.split("def call(")[1].split("def get_args(")[0]
    assert "empty_strided_cpu((120, 2, 16)" not in body, body  # no pool-sized buffer



def test_compiled_contiguous_cache_write_is_the_opaque_op_in_place():
    # generate()'s contiguous cache ([B, H, S, D] per layer, one position per row): the same rule.
    from torch._inductor.utils import run_and_get_code

    from lorazor.runner.layer_stack import LayerStack

    stack = LayerStack(2, (3, 2, 10, 16), torch.float32, "cpu")
    expected = LayerStack(2, (3, 2, 10, 16), torch.float32, "cpu")

    def step(target, layer, rows, cols, keys):
        target.put_(layer, rows, cols, keys + 1)
        return target.layer(layer).sum((0, 2)) * 2

    rows, cols, keys = torch.tensor([0, 1, 2]), torch.tensor([4, 0, 9]), torch.randn(3, 2, 16)
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(lambda *a: step(stack, *a)), 1, rows, cols, keys)
    assert torch.equal(out, step(expected, 1, rows, cols, keys)) and torch.equal(stack.flat, expected.flat)
    body = "\n".join(codes).split("def call(")[1].split("def get_args(")[0]
    assert "torch.ops.lorazor.write_positions.default(arg" in body, body
    assert "empty_strided_cpu((6, 2, 10, 16)" not in body, body
