"""Compile every LoRA kernel variant for the H100/H200 (sm_90) without a GPU; run as a script.

Used by `test_kernels_compile.py` in a subprocess, because the tests run Triton in interpreter mode.
Prints `compiled N` on success, `skip: <why>` when this Triton cannot target the GPU.
"""

import inspect
import itertools
import sys

import triton
from lorazor_kernels import lora_kernels as lk

POINTERS = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "u_ptr": "*fp32",
            "scaling_ptr": "*fp32", "sorted_rows_ptr": "*i64", "slot_start_ptr": "*i64"}
# (TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS): exact, full/active_rows, two_class large, two_class small.
GRIDS = [(True, False, 0), (False, False, 0), (False, True, 0), (False, False, 16)]


def main() -> None:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"skip: {exc}")
        return
    target = GPUTarget("cuda", 90, 32)

    def compile_sm90(kernel, consts, pointers=POINTERS):
        signature = {}
        for name in inspect.signature(kernel.fn).parameters:
            if name in consts:
                signature[name] = "constexpr"
            else:
                signature[name] = pointers.get(name, "*i32") if name.endswith("_ptr") else "i32"
        assert triton.compile(ASTSource(kernel, signature, consts), target=target).asm["cubin"]

    count = 0
    for (table, slot_list, class_rows), mask_rank in itertools.product(GRIDS, (True, False)):
        base = dict(TILE_TABLE=table, USE_SLOT_LIST=slot_list, CLASS_MAX_ROWS=class_rows, MASK_RANK=mask_rank,
                    BLOCK_M=16, DOT_PRECISION="tf32", USE_GDC=table)  # PDL with the exact grid (the H200's)
        compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=256))
        for fused in (True, False):
            compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=fused, SPLIT_K=12, BLOCK_N=128,
                                                      BLOCK_R=64 if fused else 16, BLOCK_K=256 if fused else 16))
        count += 3
    # Triton's launcher turns an int argument equal to 1 into a constant: a rank-1 bank hits that.
    base = dict(TILE_TABLE=True, USE_SLOT_LIST=False, CLASS_MAX_ROWS=0, MASK_RANK=False, BLOCK_M=16,
                DOT_PRECISION="tf32", r_max=1, USE_GDC=False)
    compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=256))
    compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=False, SPLIT_K=4, BLOCK_N=128, BLOCK_R=16, BLOCK_K=16))
    # fp32 weights and activations use IEEE dots (the fp32 GPU tests and the fp32 oracle path).
    fp32 = {k: ("*fp32" if v == "*bf16" else v) for k, v in POINTERS.items()}
    base = dict(TILE_TABLE=True, USE_SLOT_LIST=False, CLASS_MAX_ROWS=0, MASK_RANK=True, BLOCK_M=16,
                DOT_PRECISION="ieee", USE_GDC=False)
    compile_sm90(lk._lora_shrink_kernel, dict(base, BLOCK_R=16, BLOCK_K=256), fp32)
    for fused in (True, False):
        compile_sm90(lk._lora_expand_kernel, dict(base, FUSED=fused, SPLIT_K=3, BLOCK_N=128,
                                                  BLOCK_R=16, BLOCK_K=256 if fused else 16), fp32)
    # The one-program metadata build, with and without the exact grid's tile table.
    from lorazor_kernels import meta_kernel as mk

    meta_pointers = dict(row_slot_ptr="*i64", sorted_rows_ptr="*i64", slot_start_ptr="*i64")
    for tiles, rows, slots in ((True, 256, 128), (False, 1024, 1024), (True, 1024, 1024)):
        compile_sm90(mk._batch_meta_kernel, dict(BLOCK_ROWS=rows, BLOCK_SLOTS=slots, TILE_CHUNK=mk.TILE_CHUNK, BM=16,
                                                 TILES=tiles),
                     meta_pointers)
    print(f"compiled {count + 5 + 3}")


if __name__ == "__main__":
    sys.exit(main())
