"""GEMMs 2 and 3 of the fused loop, bounded by a row count that lives on the device.

The fused loop (_head's fused loop) runs over a fixed row layout: the valid rows first, then the
ignored ones (zero hidden states), their number `n_valid` a device tensor. Nothing on the host
knows it, so no host sync is needed; each kernel reads it and skips the rows past it, so ignored
rows still cost no GEMM work. For a chunk starting at row `row0` with M rows, the valid rows are
    m = clamp(n_valid − row0, 0, M).

GEMM 2, the basis (M, H) = factor ∘ (G' W) − α ∘ W[y], rows ≥ m zero:
    `_basis_partial_kernel` computes S split-K partials Σ_{v ∈ split s} G'[r, v] W[v, :] for the
    row blocks below m (an (M, H) output is small next to its K = V: at M = 1024, H = 896 there
    are 28 output tiles of (256, 128) for an H100's or H200's 132 SMs, so the V range is split
    to fill the GPU, `n_splits`); then
    `_basis_finish_kernel` sums them and applies the per-row factor and the target term (one
    fp32 pass over S · M · H, in a fixed order: deterministic, no atomics), stored in fp32 or
    split in 3 bytes (kernels/split_float: the fused loop's basis, grpo_lce._head).
GEMM 3, dW (V, H) (+)= G'[:m]ᵀ (factor ∘ X)[:m]: `_grad_w_kernel`, whose reduction (K) loop
    stops at m. The last K block may read rows in [m, ⌈m / BK⌉ BK): the fused GEMM 1 writes zeros
    there (its row tiles are multiples of BK), and the factor ∘ X operand is zero there too.
"""

from __future__ import annotations

import functools

import torch

from grpo_lce.kernels import _tuning
from grpo_lce.kernels._tma_common import num_programs
from grpo_lce.kernels._triton import HAS_TMA, HAS_TRITON

if HAS_TRITON:
    import triton

if HAS_TMA:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from grpo_lce.kernels._tma_common import dot_acc, tile_coords, valid_in_chunk
    from grpo_lce.kernels.split_float import store_f32

    @triton.jit(do_not_specialize=["row0"])
    def _basis_partial_kernel(
        g_desc, w_desc, part_ptr, n_valid_ptr, row0,
        M, H, V, k_split,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        # program (m block, n block, split): m fastest, so the programs resident together share
        # each W slab (v range, n block) through L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        m = valid_in_chunk(n_valid_ptr, row0, M)
        off_m = pid_m * BM
        if off_m < m:
            off_n = pid_n * BN
            k_lo = pid_s * k_split
            k_hi = tl.minimum(k_lo + k_split, V)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(k_lo, k_hi, BK):
                a = g_desc.load([off_m, k])
                b = w_desc.load([k, off_n])
                acc = dot_acc(a, b, acc, DOT_F32)
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            dst = part_ptr + (pid_s * M + rows).to(tl.int64)[:, None] * H + cols[None, :]
            tl.store(dst, acc, mask=(rows < M)[:, None] & (cols < H)[None, :])

    @triton.jit(do_not_specialize=["row0"])
    def _basis_finish_kernel(
        part_ptr, n_split, factor_ptr, alpha_ptr, y_ptr, w_ptr, stride_w,
        out_ptr, stride_out, lo_ptr, stride_lo, n_valid_ptr, row0, M, H,
        HAS_ALPHA: tl.constexpr, SPLIT: tl.constexpr, BH: tl.constexpr,
    ):
        r = tl.program_id(0)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        cmask = cols < H
        val = tl.zeros((BH,), dtype=tl.float32)
        if r < valid_in_chunk(n_valid_ptr, row0, M):
            for s in range(n_split):
                val += tl.load(part_ptr + (s * M + r).to(tl.int64) * H + cols, mask=cmask,
                               other=0.0)
            y = tl.load(y_ptr + r).to(tl.int64)
            w_y = tl.load(w_ptr + y * stride_w + cols, mask=cmask, other=0.0).to(tl.float32)
            a = tl.load(alpha_ptr + r) if HAS_ALPHA else 1.0
            val = tl.load(factor_ptr + r) * val - a * w_y
        r64 = r.to(tl.int64)
        store_f32(out_ptr + r64 * stride_out + cols, lo_ptr + r64 * stride_lo + cols, val, cmask,
                  SPLIT)

    @triton.jit(do_not_specialize=["row0"])
    def _grad_w_kernel(
        g_desc, xf_desc, dw_ptr, stride_dw, n_valid_ptr, row0,
        M, V, H, num_progs,
        FIRST: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_V: tl.constexpr, FLATTEN: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        # persistent over the (V / BV) x (H / BN) output tiles in groups of GROUP_V v blocks:
        # a group's G' column slabs and X's columns stay in L2 while its tiles run
        num_v = tl.cdiv(V, BV)
        num_n = tl.cdiv(H, BN)
        k_tiles = tl.cdiv(valid_in_chunk(n_valid_ptr, row0, M), BK)
        for tile in tl.range(tl.program_id(0), num_v * num_n, num_progs, flatten=FLATTEN):
            pid_v, pid_n = tile_coords(tile, num_v, num_n, GROUP_V)
            off_v = pid_v * BV
            off_n = pid_n * BN
            acc = tl.zeros((BV, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                a = g_desc.load([ki * BK, off_v])  # (BK, BV) of G': used transposed
                b = xf_desc.load([ki * BK, off_n])  # (BK, BN) of factor ∘ X
                acc = dot_acc(a.T, b, acc, DOT_F32)
            rows = off_v + tl.arange(0, BV)
            cols = off_n + tl.arange(0, BN)
            mask = (rows < V)[:, None] & (cols < H)[None, :]
            dst = dw_ptr + rows.to(tl.int64)[:, None] * stride_dw + cols[None, :]
            if not FIRST:
                acc += tl.load(dst, mask=mask, other=0.0)
            tl.store(dst, acc, mask=mask)


def n_splits(M: int, H: int, V: int, device: torch.device, cfg: dict | None = None) -> int:
    """Split-K count of the basis GEMM: the smallest whose (row block, column block, split)
    programs fill their last wave over the SMs to >= 90 % (one program per SM at these tile
    sizes), else the best filled; each split at least 8 K blocks long."""
    cfg = cfg or _tuning.BASIS_GEMM
    return _n_splits(M, H, V, num_programs(device), cfg["BM"], cfg["BN"], cfg["BK"])


@functools.lru_cache(maxsize=256)
def _n_splits(M: int, H: int, V: int, sms: int, BM: int, BN: int, BK: int) -> int:
    # (cached: the same few chunk shapes come back every call, and this loop is host time)
    tiles = triton.cdiv(M, BM) * triton.cdiv(H, BN)
    best, best_fill = 1, 0.0
    for s in range(1, max(1, min(4 * sms // tiles, triton.cdiv(V, 8 * BK))) + 1):
        progs = tiles * s
        fill = progs / (triton.cdiv(progs, sms) * sms)
        if fill >= 0.9:
            return s
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def basis_gemm(
    g: torch.Tensor,
    w: torch.Tensor,
    factor: torch.Tensor,
    alpha: torch.Tensor | None,
    y: torch.Tensor,
    n_valid: torch.Tensor,
    row0: int,
    out: torch.Tensor,
    *,
    out_lo: torch.Tensor | None = None,
    cfg: dict | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """out (M, H) fp32 = factor ∘ (g W) − α ∘ W[y] for the chunk's valid rows, 0 below them;
    with `out_lo` (M, H) uint8, out is bf16 and the pair holds the fp32 result split
    (kernels/split_float).

    g (M, V) bf16 (TMA-aligned rows), w (V, H), factor/alpha/y (M,) for the chunk's rows,
    n_valid an int32 (1,) device tensor, row0 the chunk's first row in the call.
    """
    cfg = cfg or _tuning.BASIS_GEMM
    M, V = g.shape
    H = w.shape[1]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    S = split or n_splits(M, H, V, g.device, cfg)
    k_split = triton.cdiv(triton.cdiv(V, S), BK) * BK
    S = triton.cdiv(V, k_split)
    part = torch.empty(S * M * H, device=g.device, dtype=torch.float32)
    g_desc = TensorDescriptor(g, [M, V], [g.stride(0), 1], [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w, [BK, BN])
    _basis_partial_kernel[(triton.cdiv(M, BM), triton.cdiv(H, BN), S)](
        g_desc, w_desc, part, n_valid, row0, M, H, V, k_split,
        BM=BM, BN=BN, BK=BK, DOT_F32=not g.is_cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    BH = min(1024, triton.next_power_of_2(H))
    _basis_finish_kernel[(M, triton.cdiv(H, BH))](
        part, S, factor, alpha if alpha is not None else factor, y, w, w.stride(0),
        out, out.stride(0), out_lo if out_lo is not None else out,
        out_lo.stride(0) if out_lo is not None else 0, n_valid, row0, M, H,
        HAS_ALPHA=alpha is not None, SPLIT=out_lo is not None, BH=BH, num_warps=4,
    )
    return out


def grad_w_gemm(
    dw: torch.Tensor,
    g: torch.Tensor,
    xf: torch.Tensor,
    n_valid: torch.Tensor,
    row0: int,
    *,
    first: bool,
    cfg: dict | None = None,
) -> None:
    """dw (V, H) fp32 (+)= g[:m]ᵀ xf[:m], m the chunk's valid rows; `first`: dw = (old contents
    not read). g (M, V) bf16 with zeros in rows [m, ⌈m / BK⌉ BK) (as the fused GEMM 1 writes
    it), xf (M, H) in g's dtype, zero in rows ≥ m."""
    cfg = cfg or _tuning.GRAD_W_GEMM
    M, V = g.shape
    H = xf.shape[1]
    BV, BN, BK = cfg["BV"], cfg["BN"], cfg["BK"]
    g_desc = TensorDescriptor(g, [M, V], [g.stride(0), 1], [BK, BV])
    xf_desc = TensorDescriptor.from_tensor(xf, [BK, BN])
    n_prog = min(num_programs(g.device), triton.cdiv(V, BV) * triton.cdiv(H, BN))
    _grad_w_kernel[(n_prog,)](
        g_desc, xf_desc, dw, dw.stride(0), n_valid, row0, M, V, H, n_prog,
        FIRST=first, BV=BV, BN=BN, BK=BK, GROUP_V=cfg["GROUP_V"], FLATTEN=cfg["FLATTEN"],
        DOT_F32=not g.is_cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
