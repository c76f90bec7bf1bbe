"""head_forward on the fused path: softmax statistics in GEMM 1's epilogue, no fp32 logits.

Per chunk of C rows (see kernels/gemm_softmax.py for the kernel and its precision argument):

    (once per call)     z₂ at the target of every row (kernels/target_logit)
    GEMM 1 + epilogue   partial (max, Σ2^, Σ2^·z, argmax) per (row, 256 columns) and, for a
                        gradient, G' = 2^(z₂ − c) in bf16 (C, V), c = z₂_y + SHIFT2
    reduce              lse, z_y, entropy, argmax; factor_r = α_r 2^(c_r − lse₂_r)
    flagged rows        G'_r = p_r exactly, factor_r = α_r (usually none; no host sync)
    GEMM 2              basis = factor ∘ (G' W) − α ∘ W[y]                  = α (p − e_y) W
    GEMM 3              dW += G'ᵀ (factor ∘ X),  dW[y] −= α ∘ X             = α (p − e_y)ᵀ X

Rows: with `n_valid` (an int32 device tensor, the device-counted layout of grpo_lce._rows) every
kernel reads the number of valid rows and skips the row blocks past it, and GEMMs 2 and 3 are the
Triton kernels of kernels/gemm_rows (GEMM 2 split along V to fill the GPU, GEMM 3's K loop
stopping at the count). When the count is known on the host, GEMMs 2 and 3 are cuBLAS instead
(faster at the chunk sizes the loop uses): without `n_valid` (all rows valid, counted on the
host), or with `count` (a trainable head in the device-counted layout: grpo_lce._host_count),
read once chunk 0's GEMM 1 and reduction are queued, so that the GPU has work while the host
waits for the copy; the chunks past the count are then skipped.

Compared with the unfused loop (fp32 Z written by GEMM 1, read twice by the row kernel, G written
over it) this moves C · V · 10 bytes less per chunk and writes the operand of GEMM 2 directly.
Memory: G' (C, V) in bf16 (half the unfused fp32 chunk) and the partials, C · T · 4 bytes per
statistic kept (2 to 5 of them; T = V / 128 partials a row with G', V / 256 without). Without a
gradient, no (C, V) buffer at all: the chunk then only bounds the partials.

The basis (N, H) is kept in 3 bytes a value (kernels/split_float: a bf16 array and a uint8
one, fp32 truncated to 15 mantissa bits, < 2^-15 relative): GEMM 2 sums and the target term is
subtracted in fp32 (the cancellation between p W and W[y] of a confident row happens there),
and dh = g · basis is then rounded to bf16 once, as from fp32. With `rows.scratch` (h is a copy
the call owns: the rows gathered into the device-counted layout) and no dW, chunk i's bf16 half
is written over chunk i's rows of h once its GEMM 1 and flagged rows have read them (the target
logits read every row before the loop; later chunks read only later rows): the forward then
holds h, the uint8 half, G' and the partials, 3 N H bytes where the rows and an fp32 basis
took 6 (llama-8b's 16384 x 4096 case: 192 MiB less).
Which passes come here is decided by grpo_lce._dispatch (`Path.fused`) and `HeadPass.fusable`:
the entropy-gradient operand p ∘ (z − z̄), a trainable bias, fp16/fp32 and pre-Hopper GPUs take
the unfused loop of grpo_lce._head, which stays the reference algorithm (and the CPU one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo_lce._chunks import MIN_ROWS_GRAD_WEIGHT_FUSED, chunk_bounds, fused_chunk_size
from grpo_lce._dispatch import Path
from grpo_lce._mm import accumulate_mm, mm_f32
from grpo_lce.kernels import gemm_rows as gr
from grpo_lce.kernels import gemm_softmax as gs
from grpo_lce.kernels.target_logit import target_logits
from grpo_lce.kernels.target_terms import finish_basis_and_scale_rows, scatter_target

if TYPE_CHECKING:
    from grpo_lce._head import HeadOut, HeadPass, HeadRows


def head_forward_fused(out: HeadOut, rows: HeadRows, w: torch.Tensor, b: torch.Tensor | None,
                       spec: HeadPass, path: Path) -> HeadOut:
    """Fill `out` (a HeadOut with its tensors allocated: the basis split over out.basis (N, H)
    bf16, possibly rows.h itself, and out.basis_lo, see the module docstring) for rows.h (N, H)
    in w's dtype; rows at or past the device count rows.n_valid (None: all valid) get 0
    everywhere."""
    h, y, alpha, count = rows.h, rows.y, spec.alpha, rows.count
    N = h.shape[0]
    V = w.shape[0]
    dev = h.device
    want_g = spec.basis or spec.grad_weight
    T = gs.n_parts(V, want_g)
    kinds = "ms" + ("d" if spec.entropy else "") + (
        "v" if gs.keeps_tile_max(want_g, spec.entropy, spec.argmax) else "")
    C = spec.chunk_size or fused_chunk_size(V, T, len(kinds) + spec.argmax, want_g, n_rows=N)
    if spec.grad_weight and not spec.chunk_size:  # dW accumulates once per chunk (_chunks)
        C = max(C, MIN_ROWS_GRAD_WEIGHT_FUSED)
    C = min(C, N)

    parts = {k: torch.empty(T * C, device=dev, dtype=torch.float32) for k in kinds}
    if spec.argmax:
        parts["a"] = torch.empty(T * C, device=dev, dtype=torch.int32)
    scale2 = spec.inv_tau * gs.LOG2E
    b2 = None if b is None else b.float() * scale2
    n_valid = rows.n_valid
    # the target logits (z_y, and the shift of G') of the whole call in one launch
    zy2 = target_logits(h, w, y, b2, scale2, n_valid)
    # m: the number of valid rows once the host knows it (None: only the device does)
    m = N if n_valid is None else None
    if n_valid is None:
        n_valid = torch.full((1,), N, device=dev, dtype=torch.int32)
    bounds = list(chunk_bounds(N, C))
    if want_g:
        g_buf = torch.empty(C, gs.g_row_stride(V), device=dev, dtype=w.dtype)
        factor = torch.empty(N, device=dev, dtype=torch.float32)
        # the flagged rows of the current chunk (rows of the chunk), their count per chunk
        flag_rows = torch.empty(C, device=dev, dtype=torch.int32)
        n_flag = torch.zeros(len(bounds), device=dev, dtype=torch.int32)
        gw_buf = None  # cuBLAS GEMM 2's fp32 output (C, H), made when first needed

    end = 0  # rows the loop has launched kernels for
    for i, (s, e) in enumerate(bounds):
        if m is not None and s >= m:  # every row from here on is ignored
            break
        end = e
        n = e - s
        x, yc = h[s:e], y[s:e]
        a = None if alpha is None else alpha[s:e]
        zy2_c = zy2[s:e]
        g = g_buf[:n, :V] if want_g else None
        nf = n_flag[i:i + 1] if want_g else None  # the chunk's count of flagged rows
        path.note("gemm1", n)
        gs.gemm_softmax(x, w, b2, spec.inv_tau, parts, zy2=zy2_c, g_out=g,
                        want_d=spec.entropy, want_argmax=spec.argmax, n_valid=n_valid, row0=s)
        gs.reduce_partials(
            parts, n, T,
            (out.lse[s:e], out.z_y[s:e], out.entropy[s:e] if spec.entropy else None,
             out.argmax[s:e] if spec.argmax else None),
            zy2_c, alpha=a,
            factor=factor[s:e] if want_g else None,
            flag_rows=flag_rows if want_g else None,
            n_flag=nf, n_valid=n_valid, row0=s,
        )
        if not want_g:
            continue
        # before GEMMs 2 and 3, and before the basis may overwrite x
        path.note("flagged", nf)
        gs.rewrite_flagged(g, x, w, b, spec.inv_tau, out.lse[s:e], flag_rows, nf)
        if m is None and count is not None:
            m = count.get()  # chunk 0's GEMM 1 is queued: the GPU is busy while the host waits
            path.note("count read", m)
        if m is None:  # the row count only on the device: GEMMs that read it there
            if spec.basis:
                gr.basis_gemm(g, w, factor[s:e], a, yc, n_valid, s, out.basis[s:e],
                              out_lo=out.basis_lo[s:e])
            if spec.grad_weight:  # xf is 0 past the valid rows (factor 0 there)
                xf = finish_basis_and_scale_rows(x, factor[s:e], yc, w, want_xf=True)
                gr.grad_w_gemm(out.grad_weight, g, xf, n_valid, s, first=s == 0)
                scatter_target(out.grad_weight, x, a, yc)
            continue
        k = min(e, m) - s  # the chunk's valid rows, all first
        if k == 0:  # only chunk 0 of a call with no valid row gets here
            continue
        g, x, yc, f = g[:k], x[:k], yc[:k], factor[s:s + k]
        a = None if a is None else a[:k]
        # basis = α (p − e_y) W = factor ∘ (G' W) − α ∘ W[y], finished in fp32 and stored in
        # 3 bytes, and GEMM 3's operand factor ∘ X, in one pass (kernels/target_terms)
        gw = None
        if spec.basis:
            if gw_buf is None:
                gw_buf = torch.empty(C, w.shape[1], device=dev, dtype=torch.float32)
            gw = mm_f32(g, w, out=gw_buf[:k])
        xf = finish_basis_and_scale_rows(
            x, f, yc, w, alpha=a, gw=gw,
            basis=out.basis[s:s + k] if spec.basis else None,
            basis_lo=out.basis_lo[s:s + k] if spec.basis else None,
            want_xf=spec.grad_weight)
        if spec.grad_weight:  # α (p − e_y)ᵀ X = G'ᵀ (factor ∘ X) − scatter of α ∘ X at y
            accumulate_mm(out.grad_weight, g.t(), xf, first=s == 0)
            scatter_target(out.grad_weight, x, a, yc)
    if m is not None and m < N:  # rows past the valid ones that no kernel wrote
        out.zero_rows_from(end)
        if spec.basis:  # the cuBLAS basis stopped at row m of the last chunk
            out.basis[m:end].zero_()
            out.basis_lo[m:end].zero_()
        if spec.grad_weight and m == 0:
            out.grad_weight.zero_()
    return out
