"""Compile every LoRA kernel variant for the H100/H200 (sm_90) without a GPU; run as a script.

Used by `test_kernels_compile.py` in a subprocess, because the tests run Triton in interpreter mode.
Prints `compiled N` on success, `skip: <why>` when this Triton cannot target the GPU.

`--resources` also prints the registers, stack and shared memory per thread block of the H200's
decode launches, from the cubin (`cuobjdump -res-usage`): what bounds the programs per SM.
"""

import inspect
import itertools
import os
import subprocess
import sys
import tempfile

import triton
from lorazor_kernels import lora_kernels as lk

POINTERS = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "u_ptr": "*fp32",
            "scaling_ptr": "*fp32", "sorted_rows_ptr": "*i64", "slot_start_ptr": "*i64"}
# (TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS): exact, full/active_rows, two_class large, two_class small.
GRIDS = [(True, False, 0), (False, False, 0), (False, True, 0), (False, False, 16)]
# How Triton specializes a real decode launch: arguments equal to 1 become constants (unit strides,
# the exact grid's tiles_per_slot), pointers and integers divisible by 16 are marked so (every size
# and stride of the H200 decode shapes but the rank), which turns on vector loads and cp.async.
UNIT_ARGS = ("stride_xk", "stride_ak", "stride_ur", "stride_bn", "stride_yn", "tiles_per_slot")
# ... but not the row count and tile-table length, which the kernels mark `do_not_specialize`.
NOT_DIVISIBLE_BY_16 = ("r_max", "M", "n_tiles")


def resources(compiled) -> str:
    """`REG:.. STACK:.. SHARED:..` of a compiled kernel's cubin (static shared; Triton's is dynamic)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    usage = [line.strip() for line in out.splitlines() if "REG:" in line]
    return " ".join(usage[0].split()[:2]) + f" dynamic shared {compiled.metadata.shared} B" if usage else "?"


def main() -> None:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"skip: {exc}")
        return
    target = GPUTarget("cuda", 90, 32)

    def compile_sm90(kernel, consts, pointers=POINTERS, launched=False, options=None):
        """Compile for sm_90; `launched`: with a real decode launch's specializations."""
        params = list(inspect.signature(kernel.fn).parameters)
        consts = {name: value for name, value in consts.items() if name in params}  # shared bases: expand's flags
        if launched:
            consts = {**{name: 1 for name in UNIT_ARGS if name in params}, **consts}
        signature, attrs = {}, {}
        for i, name in enumerate(params):
            if name in consts:
                signature[name] = "constexpr"
                continue
            signature[name] = pointers.get(name, "*i32") if name.endswith("_ptr") else "i32"
            if launched and name not in NOT_DIVISIBLE_BY_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=target, options=options or {})
        assert compiled.asm["cubin"]
        return compiled

    count = 0
    for (table, slot_list, class_rows), mask_rank in itertools.product(GRIDS, (True, False)):
        base = dict(TILE_TABLE=table, USE_SLOT_LIST=slot_list, CLASS_MAX_ROWS=class_rows, MASK_RANK=mask_rank,
                    BLOCK_M=16, DOT_PRECISION="tf32", USE_GDC=table, WRITE_ONLY=False)  # PDL: the exact grid (H200)
        compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=256))
        for fused in (True, False):
            compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=fused, SPLIT_K=12, BLOCK_N=128,
                                                      BLOCK_R=64 if fused else 16, BLOCK_K=256 if fused else 16))
        count += 3
    # Triton's launcher turns an int argument equal to 1 into a constant: a rank-1 bank hits that.
    base = dict(TILE_TABLE=True, USE_SLOT_LIST=False, CLASS_MAX_ROWS=0, MASK_RANK=False, BLOCK_M=16,
                DOT_PRECISION="tf32", r_max=1, USE_GDC=False, WRITE_ONLY=False)
    compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=256))
    compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=False, SPLIT_K=4, BLOCK_N=128, BLOCK_R=16, BLOCK_K=16))
    # fp32 weights and activations use IEEE dots (the fp32 GPU tests and the fp32 oracle path).
    fp32 = {k: ("*fp32" if v == "*bf16" else v) for k, v in POINTERS.items()}
    base = dict(TILE_TABLE=True, USE_SLOT_LIST=False, CLASS_MAX_ROWS=0, MASK_RANK=True, BLOCK_M=16,
                DOT_PRECISION="ieee", USE_GDC=False, WRITE_ONLY=False)
    compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=256), fp32)
    for fused in (True, False):
        compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=fused, SPLIT_K=3, BLOCK_N=128,
                                                  BLOCK_R=16, BLOCK_K=256 if fused else 16), fp32)
    # The H200's decode launches (exact grid, bf16, merged uniform-rank banks, PDL, its kernel config):
    # the code that actually runs there, vectorized and pipelined.
    from lorazor_kernels import KernelConfig
    from lorazor_kernels.kernel_config import CONFIG_DIR

    cfg = KernelConfig.from_json(CONFIG_DIR / "NVIDIA_H200.json")
    base = dict(TILE_TABLE=True, USE_SLOT_LIST=False, CLASS_MAX_ROWS=0, MASK_RANK=False, BLOCK_M=16,
                DOT_PRECISION="tf32", USE_GDC=cfg.pdl, WRITE_ONLY=False)
    shrink = compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=cfg.shrink_block_k), launched=True,
                          options=dict(num_warps=cfg.shrink_num_warps, num_stages=cfg.shrink_num_stages))
    expand = compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=False, SPLIT_K=8, BLOCK_N=cfg.expand_block_n,
                                                       BLOCK_R=16, BLOCK_K=16), launched=True,
                          options=dict(num_warps=cfg.expand_num_warps, num_stages=cfg.expand_num_stages))
    # ... and the write-only expand of `KernelConfig.gemm_adds_lora`.
    compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=False, SPLIT_K=8, BLOCK_N=cfg.expand_block_n, BLOCK_R=16,
                                              BLOCK_K=16, WRITE_ONLY=True), launched=True,
                 options=dict(num_warps=cfg.expand_num_warps, num_stages=cfg.expand_num_stages))
    count += 3
    if "--resources" in sys.argv:
        print(f"Triton {triton.__version__}, sm_90: H200 shrink ({cfg.shrink_num_warps} warps): {resources(shrink)}")
        print(f"H200 expand ({cfg.expand_block_n} columns, {cfg.expand_num_warps} warps): {resources(expand)}")
    # The one-program metadata build, with and without the exact grid's tile table.
    from lorazor_kernels import meta_kernel as mk

    meta_pointers = dict(row_slot_ptr="*i64", sorted_rows_ptr="*i64", slot_start_ptr="*i64")
    for tiles, rows, slots in ((True, 256, 128), (False, 1024, 1024), (True, 1024, 1024)):
        compile_sm90(mk._batch_meta_kernel, dict(BLOCK_ROWS=rows, BLOCK_SLOTS=slots, TILE_CHUNK=mk.TILE_CHUNK, BM=16,
                                                 TILES=tiles),
                     meta_pointers)
    # The fp8 weight-only GEMM: per-channel scales split over K with programmatic dependent launch (its decode
    # path on the H100 and H200), block-scaled without.
    from lorazor_kernels import fp8

    fp8_pointers = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", scale_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16",
                        part_ptr="*fp32", count_ptr="*i32")
    for split, blocks, gdc in ((True, False, True), (False, True, False)):
        compile_sm90(fp8._weight_only_kernel, dict(HAS_BIAS=blocks, SPLIT=split, BLOCK_SCALED=blocks,
                                                   SCALE_BLOCK=fp8.SCALE_BLOCK, BLOCK_M=fp8.WEIGHT_ONLY_ROWS,
                                                   BLOCK_N=32, BLOCK_K=128 if blocks else 512, USE_GDC=gdc),
                     fp8_pointers, options=dict(num_warps=4, num_stages=3))
    count += 2
    # The async step's token fill.
    from lorazor_kernels import token_fill

    for slots in ("*i32", "*i64"):
        compile_sm90(token_fill._fill_pending_kernel, dict(BLOCK=token_fill.BLOCK),
                     dict(ids_ptr="*i64", slots_ptr=slots, index_ptr="*i64", values_ptr="*i64"))
    print(f"compiled {count + 5 + 3 + 2}")


if __name__ == "__main__":
    sys.exit(main())
