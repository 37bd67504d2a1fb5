"""fp8 base weights: per-output-channel quantization to float8_e4m3fn and the GEMM over them.

Semantics:
    scale[n] = max_k |W[n, k]| / 448                       # per output channel, float32
    W8[n, k] = float8_e4m3fn(W[n, k] / scale[n])
    fp8_linear(x, W8, scale, b) ~= x @ (W8 * scale[:, None]).T + b

On a GPU, a product of at most `WEIGHT_ONLY_ROWS` rows (decode at small batch: bound by reading the
weights) is one Triton kernel that widens the fp8 weights in registers and keeps x in its own dtype
(`fp8_weight_only`; a GEMM too narrow to fill the GPU splits K over more programs, and the last
program of each column block adds the partial sums). With more rows, on a GPU with fp8 matrix units
(compute capability >= 8.9), activations are quantized per token on the fly (a scale per row of x,
as vLLM's `--quantization fp8` does; one Triton kernel, `quantize_tokens`, that also pads the rows
to `_scaled_mm`'s multiple) and the product runs in `torch._scaled_mm` with both scales applied in
its epilogue.
Elsewhere (the CPU) the weights are dequantized to x's dtype and the product is a plain linear: the
same weights, activations unrounded.

Block-scaled weights (an fp8 checkpoint's own, the Hugging Face "fp8" format with
`weight_block_size` [128, 128]): `scale` is then `[ceil(N / 128), ceil(K / 128)]`, one multiplier
per 128x128 block (`W[n, k] = W8[n, k] * scale[n // 128, k // 128]`), and the GEMM keeps them: on a
GPU the weight-only kernel at every row count (each K tile lies in one scale block: its partial
product takes the block's scales per column before it joins the fp32 sums), elsewhere the
dequantized reference. x is never quantized on this path.
`fp8_linear_reference` is the dequantized definition; `scaled=True` forces the `_scaled_mm` path
(torch runs it on the CPU too, so tests check it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_config import get_kernel_config
from .lora_launch import _cuda_index, _sm_count, pdl_launch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# torch._scaled_mm's GPU kernels want the rows of x in multiples of this.
ROW_MULTIPLE = 16
# The smallest scale: an all-zero row quantizes to zeros, never divides by zero.
MIN_SCALE = 1e-12
# Up to this many rows (a decode step of a few requests) the GEMM reads the fp8 weights with x in its
# own dtype (`fp8_weight_only`); more rows quantize x per token for the fp8 matrix units.
WEIGHT_ONLY_ROWS = 16
# The block of a block-scaled weight (a 2-D `scale`), and the weight-only launch for block-scaled
# products of more rows: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
SCALE_BLOCK = 128
BLOCK_SCALED_LAUNCH = (64, 128, 128, 4, 3)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 `[N, K]` float8_e4m3fn, scale `[N]` float32) for a `[N, K]` weight, per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def block_scaled(scale: torch.Tensor) -> bool:
    """Whether `scale` holds 128x128 block scales (2-D) rather than one per output channel."""
    return scale.dim() == 2


def check_block_scales(weight: torch.Tensor, scale: torch.Tensor) -> None:
    n, k = weight.shape
    expected = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scales of shape {tuple(scale.shape)} for a {n}x{k} fp8 weight in "
                         f"{SCALE_BLOCK}x{SCALE_BLOCK} blocks; expected {expected}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 * scale in `dtype` (the weights an fp8 layer computes with): per output channel
    (`scale[:, None]`), or per 128x128 block for a 2-D `scale`."""
    if block_scaled(scale):
        n, k = weight.shape
        scale = scale.float().repeat_interleave(SCALE_BLOCK, 0)[:n].repeat_interleave(SCALE_BLOCK, 1)[:, :k]
        return (weight.float() * scale).to(dtype)
    return (weight.float() * scale.float()[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: a linear over the dequantized weights, in x's dtype."""
    return torch.nn.functional.linear(x, dequantize(weight, scale, x.dtype), bias)


def quantize_tokens_reference(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 `[rows, K]` float8_e4m3fn, scale `[rows, 1]` float32): x `[M, K]` quantized per row, padded
    with zero rows to `rows` >= M."""
    if rows > x.shape[0]:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_x, stride_q, BLOCK_K: tl.constexpr,
                            FP8_LIMIT: tl.constexpr, SCALE_FLOOR: tl.constexpr):
    # One program per output row; rows >= M (the padding) read as zeros.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=(k0 + cols < K) & (row < M), other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_LIMIT, SCALE_FLOOR)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=(k0 + cols < K) & (row < M), other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -FP8_LIMIT, FP8_LIMIT)
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)
    tl.store(scale_ptr + row, scale)


def quantize_tokens(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens_reference` in one kernel launch (a GPU tensor; the reference elsewhere)."""
    if not x.is_cuda:
        return quantize_tokens_reference(x, rows)
    x = x if x.stride(-1) == 1 else x.contiguous()
    K = x.shape[1]
    x8 = torch.empty(rows, K, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _quantize_tokens_kernel[(rows,)](x, x8, scale, x.shape[0], K, x.stride(0), x8.stride(0),
                                     BLOCK_K=min(4096, triton.next_power_of_2(K)), FP8_LIMIT=FP8_MAX,
                                     SCALE_FLOOR=MIN_SCALE)
    return x8, scale


def scaled_mm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs fp8 on `device`'s matrix units (Ada, Hopper and newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _weight_only_epilogue(acc, scale_ptr, bias_ptr, y_ptr, M, N, stride_y, rows, cols, HAS_BIAS: tl.constexpr,
                          BLOCK_SCALED: tl.constexpr):
    # Each channel's scale (and the bias) apply once, to the finished fp32 sums (block scales already
    # applied per K tile).
    if not BLOCK_SCALED:
        acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _weight_only_dot(acc, x, w, scale_ptr, cols, k_tile, N, stride_s, BLOCK_SCALED: tl.constexpr,
                     SCALE_BLOCK: tl.constexpr):
    """acc + x @ w.T (the fp8 weights widened in registers); block-scaled weights: times the K tile's
    scale per channel."""
    if BLOCK_SCALED:
        block_scale = tl.load(scale_ptr + (cols // SCALE_BLOCK) * stride_s + k_tile // SCALE_BLOCK, mask=cols < N,
                              other=0.0)
        return acc + tl.dot(x, tl.trans(w.to(x.dtype))) * block_scale[None, :]
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, SPLIT_K,
                        stride_x, stride_w, stride_y, stride_s, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_SCALED: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
    # Program (n, s, m): BLOCK_N output channels, BLOCK_M rows from the m-th, the s-th K_SPLIT columns
    # of K. The fp8 weights are read once per row block and widened in registers (every
    # float8_e4m3fn value is exact in bf16 and fp16); the products accumulate in fp32. Block-scaled
    # weights: BLOCK_K divides SCALE_BLOCK, so a K tile's columns share one scale per channel.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT  # < K: every split has columns (`plan_split_k`)
    start = 0
    if USE_GDC:  # `KernelConfig.fp8_pdl`
        # The first K tile's weights before the wait for the kernel ahead: weights never depend on it,
        # so with programmatic dependent launch this read overlaps its tail.
        k = k_begin + ks
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        tl.extra.cuda.gdc_wait()  # x, the partials and y only after the kernel ahead is done
        tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        acc = _weight_only_dot(acc, x, w, scale_ptr, cols, k_begin, N, stride_s, BLOCK_SCALED, SCALE_BLOCK)
        start = BLOCK_K
    for k0 in range(start, K_SPLIT, BLOCK_K):  # the last split's columns past K are masked
        k = k_begin + k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        acc = _weight_only_dot(acc, x, w, scale_ptr, cols, k_begin + k0, N, stride_s, BLOCK_SCALED, SCALE_BLOCK)
    if not SPLIT:
        _weight_only_epilogue(acc, scale_ptr, bias_ptr, y_ptr, M, N, stride_y, rows, cols, HAS_BIAS, BLOCK_SCALED)
    else:
        # Split K (SPLIT_K > 1 programs per column block; a runtime value, so the sweep's splits share
        # one compiled kernel): each program writes its partial sums, and the last of a column block's
        # programs to finish (its arrival counter) adds them up and writes y, then zeroes the counter
        # for the next launch. One launch, no memset, no second kernel.
        tile = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        block = BLOCK_M * BLOCK_N
        tl.store(part_ptr + (pid_k * tl.num_programs(0) + pid_n) * block + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # .cg: read the partials from L2, where the other programs wrote them
                acc += tl.load(part_ptr + (s * tl.num_programs(0) + pid_n) * block + tile, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            _weight_only_epilogue(acc, scale_ptr, bias_ptr, y_ptr, M, N, stride_y, rows, cols, HAS_BIAS,
                                  BLOCK_SCALED)


# The arrival counters of split-K launches, per device: zeroed once, and each launch leaves them zeroed
# (kernels on one stream run one after another, so launches never share them at once).
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_COLUMN_BLOCKS = 4096


def _split_k(column_blocks: int, K: int, block_k: int, device: torch.device, programs_per_sm: int) -> int:
    """Splits of K for a launch of `column_blocks` column blocks: none if they fill the multiprocessors,
    else enough for `programs_per_sm` programs per multiprocessor, at most one BLOCK_K per split."""
    sms = _sm_count(_cuda_index(device)) if device.type == "cuda" else 1
    if column_blocks >= sms:
        return 1
    return min(triton.cdiv(programs_per_sm * sms, column_blocks), triton.cdiv(K, block_k))


def plan_split_k(column_blocks: int, K: int, block_k: int, device: torch.device, programs_per_sm: int,
                 forced: int = 0) -> tuple[int, int]:
    """(splits, K columns per split) of a few rows' weight-streaming GEMM (the weight-only kernel):
    `forced` splits if > 0, else `_split_k`'s; each split whole BLOCK_Ks, so rounding can
    leave fewer splits than asked."""
    split_k = forced or _split_k(column_blocks, K, block_k, device, programs_per_sm)
    k_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    return triton.cdiv(K, k_split), k_split


def arrival_counters(device: torch.device, column_blocks: int, who: str) -> torch.Tensor:
    """The split-K arrival counters on `device` (one per column block, zeroed once, left zeroed by
    every launch); refuses more column blocks than they hold, naming `who` and the count."""
    if column_blocks > _MAX_COLUMN_BLOCKS:
        raise ValueError(f"{who} splits K for at most {_MAX_COLUMN_BLOCKS} column blocks, got {column_blocks}")
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(_MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
    return counters


def fp8_weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    launch: tuple[int, ...] | None = None) -> torch.Tensor:
    """`fp8_linear` with x unquantized, in one kernel launch: for a few rows (at most
    `WEIGHT_ONLY_ROWS`: a decode step of a few rows is bound by reading the weights, and cuBLASLt's
    fp8 GEMM runs a 128x128 tile over them; on the H100 it read the fp8 weights no faster than bf16
    ones), and for block-scaled weights at any row count (`BLOCK_SCALED_LAUNCH` past
    `WEIGHT_ONLY_ROWS`). Narrow GEMMs of a few rows split K across programs so the whole GPU reads
    (`KernelConfig.fp8_programs_per_sm`). `launch`: (BLOCK_N, BLOCK_K, num_warps, num_stages[,
    split_k]) for a few rows, for the probe's sweep; None: the device's kernel config
    (`KernelConfig.fp8_*`); split_k 0 or absent: chosen by `_split_k`."""
    M, K = x.shape
    N = weight.shape[0]
    blocks = block_scaled(scale)  # their shape is checked once, where the layer is built (`check_block_scales`)
    if M > WEIGHT_ONLY_ROWS and not blocks:
        raise ValueError(f"fp8_weight_only takes per-channel weights for at most {WEIGHT_ONLY_ROWS} rows, got {M}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    config = get_kernel_config(x.device)
    if M > WEIGHT_ONLY_ROWS:  # block-scaled, many rows: row blocks too, K whole
        block_m, block_n, block_k, warps, stages = BLOCK_SCALED_LAUNCH
        split = [1]
    else:
        block_m = WEIGHT_ONLY_ROWS
        block_n, block_k, warps, stages, *split = launch or (config.fp8_block_n, config.fp8_block_k,
                                                             config.fp8_num_warps, config.fp8_num_stages)
        if len(split) > 1 or (split and split[0] < 0):
            raise ValueError(f"fp8_weight_only launch takes (BLOCK_N, BLOCK_K, warps, stages[, split_k >= 0]), "
                             f"got {launch}")
    if blocks:
        block_k = min(block_k, SCALE_BLOCK)
        if SCALE_BLOCK % block_k:
            raise ValueError(f"a block-scaled fp8 GEMM needs BLOCK_K dividing {SCALE_BLOCK}, got {block_k}")
    column_blocks = triton.cdiv(N, block_n)
    split_k, k_split = plan_split_k(column_blocks, K, block_k, x.device, config.fp8_programs_per_sm,
                                    split[0] if split else 0)
    if split_k > 1:
        counters = arrival_counters(x.device, column_blocks, "fp8_weight_only")
        partials = torch.empty(split_k * column_blocks * block_m * block_n, dtype=torch.float32, device=x.device)
    else:
        counters = partials = scale  # unused
    _weight_only_kernel[(column_blocks, split_k, triton.cdiv(M, block_m))](
        x, weight, scale, bias if bias is not None else scale, y, partials, counters, M, N, K, k_split, split_k,
        x.stride(0), weight.stride(0), y.stride(0), scale.stride(0), HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        BLOCK_SCALED=blocks, SCALE_BLOCK=SCALE_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl_launch(config.fp8_pdl, x.device))
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               scaled: bool | None = None) -> torch.Tensor:
    """`x [M, K]` times fp8 `weight [N, K]` with per-channel `scale [N]` (or 128x128 block scales, 2-D),
    plus `bias`; `[M, N]` in x's dtype. On a GPU, up to `WEIGHT_ONLY_ROWS` rows (and block-scaled
    weights at any row count) run `fp8_weight_only` (x unquantized); more rows run `_scaled_mm` with
    per-token activation scales where the GPU has fp8 matrix units. `scaled`: force the `_scaled_mm`
    path (True) or the dequantized reference (False)."""
    blocks = block_scaled(scale)
    if (scaled is None and (x.shape[0] <= WEIGHT_ONLY_ROWS or blocks) and x.dtype in (torch.bfloat16, torch.float16)
            and scaled_mm_available(x.device)):  # Triton widens float8_e4m3fn on the same GPUs
        return fp8_weight_only(x, weight, scale, bias)
    if blocks:
        if scaled:
            raise ValueError("block-scaled fp8 weights take the weight-only kernel or the reference, not _scaled_mm")
        return fp8_linear_reference(x, weight, scale, bias)
    if scaled is None:  # the GPU's fp8 rowwise-scaled GEMM writes bf16, over dims in multiples of 16
        scaled = (x.dtype == torch.bfloat16 and scaled_mm_available(x.device)
                  and not weight.shape[0] % ROW_MULTIPLE and not weight.shape[1] % ROW_MULTIPLE)
    if not scaled:
        return fp8_linear_reference(x, weight, scale, bias)
    rows = x.shape[0]
    padded = rows + (-rows % ROW_MULTIPLE if x.is_cuda else 0)
    x8, x_scale = quantize_tokens(x, padded)
    # weight.t() of a row-major [N, K] is the column-major [K, N] _scaled_mm wants for its second operand.
    y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.float()[None, :], out_dtype=x.dtype,
                         bias=None if bias is None else bias.to(x.dtype))
    return y[:rows] if padded != rows else y


def _fp8_linear_default(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return fp8_linear(x, weight, scale, bias)


# The fp8 GEMM as an opaque op for compiled steps (a backbone-only step calls it outside the LoRA op):
# traced, its Triton quantization kernel and `_scaled_mm` made inductor fail on the H100
# (`InductorError: KeyError: 'op17'`), and there is nothing for inductor to fuse in it anyway.
fp8_linear_op = torch.library.custom_op("lorazor::fp8_linear", mutates_args=())(_fp8_linear_default)


@fp8_linear_op.register_fake
def _(x, weight, scale, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
