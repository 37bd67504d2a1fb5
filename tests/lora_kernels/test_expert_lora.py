"""The MoE expert kernels against their gathering torch references. `expert_gemv`: a decode step's
token-expert pairs through their experts' base weights, on strided expert blocks, odd N and K.
`expert_lora`: each MoE token-expert pair's LoRA deltas (one or two projections side by side) from its own
slot and expert, read in place, against the gathering torch reference; on the bank's own strided views (each
expert's B contiguous, or all experts' columns in each rank row), with pairs of no adapter (slot -1), a slot
of a lower rank (zero past it), odd K, N and pair counts, ranks that are not a power of two, split K and wide
column blocks."""

import json
import os
import subprocess
import sys

import pytest
import torch

# (slots L, experts E, r_max, K, N, pairs P, projections J); r_max 6 and 12: not a power of two (the kernels mask
# the rank block); few pairs split K (1,000 over 4 splits, 600 over 2 with the second past K), 130 pairs take wide
# column blocks (N 300: a partial one)
CASES = [(3, 5, 16, 40, 70, 23, 1), (2, 8, 8, 128, 33, 1, 2), (4, 3, 32, 200, 129, 64, 1), (1, 2, 16, 64, 64, 0, 2),
         (3, 4, 6, 50, 40, 17, 2), (2, 3, 12, 130, 65, 9, 1), (3, 4, 16, 1000, 48, 1, 2), (2, 3, 8, 600, 40, 3, 1),
         (3, 6, 16, 72, 300, 130, 2)]

SCRIPT = """
import json, sys, torch
from lorazor_kernels import expert_lora, expert_lora_reference

def stack(L, E, r, K, N, g, device, per_expert):
    # The bank's layout: one storage row per slot, A blocks [E * r, K], then each expert's B stored [r, N]
    # (per_expert) or, as a merged group's B, all experts' columns in each rank row: [r, E * N].
    row = E * r * K + r * E * N + 5
    storage = torch.randn(L, row, generator=g).to(device)
    lora_a = storage[:, :E * r * K].view(L, E, r, K)
    b_store = storage[:, E * r * K:E * r * K + r * E * N]
    lora_b = (b_store.view(L, E, r, N).transpose(2, 3) if per_expert
              else b_store.view(L, r, E * N).transpose(1, 2).unflatten(1, (E, N)))
    lora_a[0, :, r // 2:] = 0
    lora_b[0, :, :, r // 2:] = 0  # slot 0 holds an adapter of half the rank
    return lora_a, lora_b, torch.rand(E + 1, L, generator=g)[1:].to(device)

def case(L, E, r, K, N, P, J, device):
    g = torch.Generator().manual_seed(L * 1000 + E * 100 + P)
    stacks = [stack(L, E, r, K, N, g, device, per_expert=P % 2 == 1) for _ in range(J)]
    lora_a, lora_b, scaling = ([s[i] for s in stacks] for i in range(3))
    slot = torch.randint(-1, L, (P,), generator=g).to(device)
    expert = torch.randint(0, E, (P,), generator=g).to(device)
    x = torch.randn(P, K, generator=g).to(device)
    got, ref = expert_lora(x, lora_a, lora_b, scaling, slot, expert), expert_lora_reference(
        x, lora_a, lora_b, scaling, slot, expert)
    # each projection's columns against that projection alone (the side-by-side order)
    alone = [expert_lora_reference(x, [a], [b], [s], slot, expert) for a, b, s in zip(lora_a, lora_b, scaling)]
    scale = ref.abs().max().item() if P else 1.0
    return dict(error=(got - ref).abs().max().item() / max(scale, 1e-6) if P else 0.0,
                side_by_side=bool(torch.equal(ref, torch.cat(alone, dim=-1))),
                zero_where_no_adapter=bool((got[slot < 0] == 0).all()) if P else True, shape=list(got.shape))

print(json.dumps([case(*c, sys.argv[2]) for c in json.loads(sys.argv[1])]))
"""


# Each kernel test runs in Triton's interpreter on a CPU machine, and compiled on a GPU (where the interpreter run
# is skipped: the compiled one covers it).
ON_DEVICES = [pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
                  torch.cuda.is_available(), reason="on a GPU the compiled kernels run instead")),
              pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


def run_script(script: str, cases: list, device: str, interpret: bool) -> list[dict]:
    """`script`'s JSON results for `cases` on `device`, in a fresh process (Triton's interpreter or not)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # read when a kernel is defined: a fresh process
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases), device], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def run(device: str, interpret: bool) -> list[dict]:
    return run_script(SCRIPT, CASES, device, interpret)


def check(results):
    for (L, E, r, K, N, P, J), got in zip(CASES, results, strict=True):
        assert got["shape"] == [P, J * N] and got["side_by_side"]
        assert got["error"] < 1e-4 and got["zero_where_no_adapter"], ((L, E, r, K, N, P, J), got)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_expert_lora_equals_its_reference(device):
    check(run(device, interpret=device == "cpu"))


GEMV_CASES = [(5, 70, 40, 3), (8, 257, 130, 32), (3, 64, 128, 1), (2, 33, 200, 0)]  # (E, N, K, pairs)

GEMV_SCRIPT = """
import json, sys, torch
from lorazor_kernels import expert_gemv, expert_gemv_reference, quantize_experts
from lorazor_kernels.fp8 import dequantize

out = []
for E, N, K, P in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(E * 100 + P)
    # A fused gate_up-like block: the experts' rows inside a wider storage row (strided experts).
    weight = torch.randn(E, N + 3, K, generator=g).to(sys.argv[2])[:, 1:N + 1]
    x = torch.randn(P, K, generator=g).to(sys.argv[2])
    expert = torch.randint(0, E, (P,), generator=g).to(sys.argv[2])
    got, ref = expert_gemv(x, weight, expert), expert_gemv_reference(x, weight, expert)
    # fp8 experts: float8 weights, a scale per expert and output channel; the definition on the dequantized weights
    w8, scale = quantize_experts(weight)
    fp8 = expert_gemv(x, w8, expert, scale)
    exact = torch.bmm(dequantize(w8.flatten(0, 1), scale.flatten(), torch.float32).view(E, N, K)[expert],
                      x[:, :, None])[..., 0]
    top = lambda t: max(t.abs().max().item(), 1e-6) if P else 1.0
    out.append(dict(error=(got - ref).abs().max().item() / top(ref) if P else 0.0, shape=list(got.shape),
                    fp8_error=(fp8 - exact).abs().max().item() / top(exact) if P else 0.0,
                    fp8_reference_error=(expert_gemv_reference(x, w8, expert, scale) - exact).abs().max().item()
                    / top(exact) if P else 0.0))
print(json.dumps(out))
"""


def run_gemv(device: str, interpret: bool) -> None:
    results = run_script(GEMV_SCRIPT, GEMV_CASES, device, interpret)
    for (E, N, K, P), got in zip(GEMV_CASES, results, strict=True):
        assert got["shape"] == [P, N] and got["error"] < 1e-4, ((E, N, K, P), got)
        assert got["fp8_error"] < 1e-4 and got["fp8_reference_error"] < 1e-5, ((E, N, K, P), got)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_expert_gemv_equals_its_reference(device):
    run_gemv(device, interpret=device == "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", [1, 37, 600])
def test_gpu_grouped_fp8_experts_equal_their_definition(pairs):
    # A sorted step's fp8 experts (`expert_grouped_fp8`: activations quantized per token, torch's scaled grouped
    # GEMM on a Hopper GPU) against the definition on the same quantized activations and dequantized weights
    # (fp32): only the GEMM's accumulation and its bf16 output differ. Experts with no pair included.
    from lorazor_kernels import expert_gemv_reference, expert_grouped_fp8, quantize_experts
    from lorazor_kernels.fp8 import dequantize, quantize_tokens_reference

    E, N, K = 6, 96, 160
    g = torch.Generator().manual_seed(pairs)
    w8, scale = quantize_experts(torch.randn(E, N, K, generator=g).cuda())
    x = torch.randn(pairs, K, generator=g).cuda().bfloat16()
    expert = torch.sort(torch.randint(0, E - 1, (pairs,), generator=g).cuda()).values  # expert E-1: no pair
    offsets = torch.cumsum(torch.bincount(expert, minlength=E), 0).int()
    got = expert_grouped_fp8(x, w8, scale, offsets, expert.int())
    x8, x_scale = quantize_tokens_reference(x, pairs)
    exact = expert_gemv_reference(x8.float() * x_scale, dequantize(w8.flatten(0, 1), scale.flatten(), torch.float32)
                                  .view(E, N, K), expert)
    error = ((got.float() - exact).norm() / exact.norm()).item()
    assert got.dtype == torch.bfloat16 and got.shape == (pairs, N) and error < 1e-2, error


COMBINE_CASES = [(7, 8, 70), (1, 2, 33), (5, 3, 1030), (0, 2, 16)]  # (tokens, top_k, N)

COMBINE_SCRIPT = """
import json, sys, torch
from lorazor_kernels import expert_combine, expert_combine_reference

out = []
for T, k, N in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(T * 10 + k)
    for dtype in (torch.float32, torch.bfloat16):
        experts = torch.randint(0, 6, (T * k,), generator=g)
        _, perm = torch.sort(experts, stable=True)  # pair order -> sorted position, as the MoE layer sorts
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        sorted_out = torch.randn(T * k, N + 5, generator=g).to(dtype)[:, 2:N + 2]  # a strided [P, N] view
        weights = torch.rand(T, k, generator=g)
        dev = sys.argv[2]
        got = expert_combine(sorted_out.to(dev), inverse.to(dev), weights.to(dev)).cpu()
        ref = expert_combine_reference(sorted_out, inverse, weights)
        # the definition: pair p = t * k + j sits at sorted position inverse[p], i.e. perm[inverse[p]] == p
        unsorted = torch.empty_like(sorted_out).float()
        unsorted[perm] = sorted_out.float()
        exact = (unsorted.view(T, k, N) * weights[..., None]).sum(dim=1)
        top = max(exact.abs().max().item(), 1e-6) if T else 1.0
        err = lambda t: (t.float() - exact).abs().max().item() / top if T else 0.0
        out.append(dict(shape=list(got.shape), dtype=str(got.dtype), error=err(got), reference_error=err(ref)))
print(json.dumps(out))
"""


def run_combine(device: str, interpret: bool) -> None:
    results = run_script(COMBINE_SCRIPT, COMBINE_CASES, device, interpret)
    for case, got in zip([c for c in COMBINE_CASES for _ in range(2)], results, strict=True):
        T, k, N = case
        bound = 1e-5 if got["dtype"] == "torch.float32" else 1e-2  # bf16: the output's rounding
        assert got["shape"] == [T, N] and got["error"] < bound and got["reference_error"] < bound, (case, got)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_expert_combine_equals_its_definition(device):
    run_combine(device, interpret=device == "cpu")
