"""The chunk loop shared by linear_logprobs and linear_cross_entropy.

h (N, H), W (V, H), b (V,), y (N,) (all rows valid: ignored rows are compacted away before),
τ;  z = (h Wᵀ + b) / τ  in chunks of C rows (fp32, never (N, V)).

`head_forward` returns lse, z_y, entropy (and argmax) per row and, on request, GEMMs against the
softmax-derived operands G, E of `kernels.row_softmax` while the chunk is still in memory:
    basis   = G W   (N, H) fp32       with G = α(p − e_y) + β p∘(z − z̄)
    ebasis  = E W   (N, H) fp32       with E = p∘(z − z̄)
    dW     += Gᵀ h  (V, H) fp32       (and db += Σ_rows G)
Extra memory: one chunk, C · V · 4 bytes (G is written over the chunk's own logits; E, when
asked for, takes C · V · 2 more), plus the (N, H) outputs asked for. The fused path (Hopper,
bf16) keeps the basis in 3 bytes a value (kernels/split_float), its bf16 half over h's own rows
when the caller owns them (_head_fused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lce._chunks import (
    MIN_ROWS_GRAD_WEIGHT,
    accumulate_mm,
    chunk_bounds,
    default_chunk_size,
    mm_f32,
)
from grpo_lce._head_fused import head_forward_fused, use_fused
from grpo_lce._rows import valid_mask
from grpo_lce.kernels.row_softmax import row_softmax, select_backend


def gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the GEMMs consume it. On CUDA the bf16/fp16 weight itself (cuBLAS writes
    fp32); on CPU, which has no mixed-dtype GEMM, one fp32 copy per call instead of per chunk
    (except under the Triton backend, i.e. the interpreter in tests, whose fused GEMM takes
    bf16 tiles)."""
    if weight.is_cuda or weight.dtype == torch.float32 or select_backend(weight) == "triton":
        return weight
    return weight.float()


@dataclass
class HeadOut:
    lse: torch.Tensor  # (N,) fp32
    z_y: torch.Tensor  # (N,) fp32
    entropy: torch.Tensor | None  # (N,) fp32; None unless want_entropy (fused path)
    argmax: torch.Tensor | None = None  # (N,) int64
    basis: torch.Tensor | None = None  # (N, H) fp32: G W (fused path: its bf16 half, ...
    basis_lo: torch.Tensor | None = None  # ... and this (N, H) uint8 one: kernels/split_float)
    ebasis: torch.Tensor | None = None  # (N, H) fp32: E W
    grad_weight: torch.Tensor | None = None  # (V, H) fp32: Gᵀ h
    grad_bias: torch.Tensor | None = None  # (V,) fp32: Σ G

    def zero_rows_from(self, start: int) -> None:
        """Per-row outputs of rows start.. set to 0 (argmax −1): rows past the valid ones that
        no kernel wrote (dW and db need nothing: those rows contribute 0)."""
        for t in (self.lse, self.z_y, self.entropy, self.basis, self.basis_lo, self.ebasis):
            if t is not None:
                t[start:].zero_()
        if self.argmax is not None:
            self.argmax[start:].fill_(-1)


def head_forward(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    y: torch.Tensor,
    inv_tau: float,
    chunk_size: int | None,
    *,
    want_basis: bool = False,
    want_ebasis: bool = False,
    want_grad_weight: bool = False,
    want_grad_bias: bool = False,
    want_argmax: bool = False,
    want_entropy: bool = True,
    alpha: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    count=None,
    rows_scratch: bool = False,
) -> HeadOut:
    """One pass over the rows of h in chunks. `w` is `gemm_weight(weight)`.

    `n_valid` (int32 (1,) on the device): only the first n_valid rows are valid, the others
    (zero hidden states, α = β = 0: _rows' device-counted layout) get 0 in every output. The
    fused path skips their GEMM work; the unfused loop computes and then zeroes them, unless
    `count` (_rows.HostCount, the same number on its way to the host) lets it stop at them.

    want_basis/want_grad_weight/want_grad_bias all use the same operand G (α, β per row).
    `rows_scratch`: h is a copy owned by the call (never the caller's tensor), which the fused
    path may overwrite with the basis's bf16 half (see _head_fused).
    On a Hopper GPU most calls take the fused path of `_head_fused` (same outputs; entropy only
    when `want_entropy`); the loop below is the reference algorithm and the CPU one.
    """
    N, H = h.shape
    V = w.shape[0]
    dev = h.device
    want_g = want_basis or want_grad_weight or want_grad_bias
    h_gemm = h if h.dtype == w.dtype else h.to(w.dtype)
    fused = N > 0 and use_fused(
        h_gemm, w, want_ebasis=want_ebasis, want_grad_bias=want_grad_bias, beta=beta
    )
    basis, basis_lo = _basis_buffers(h_gemm, fused, rows_scratch and not want_grad_weight) \
        if want_basis else (None, None)
    out = HeadOut(
        lse=torch.empty(N, device=dev, dtype=torch.float32),
        z_y=torch.empty(N, device=dev, dtype=torch.float32),
        entropy=torch.empty(N, device=dev, dtype=torch.float32)
        if want_entropy or not fused else None,
        argmax=torch.empty(N, device=dev, dtype=torch.int64) if want_argmax else None,
        basis=basis,
        basis_lo=basis_lo,
        ebasis=torch.empty(N, H, device=dev, dtype=torch.float32) if want_ebasis else None,
        # the fused loop's first chunk writes dW (no zero fill of V x H fp32 first)
        grad_weight=(torch.empty if fused else torch.zeros)(V, H, device=dev,
                                                             dtype=torch.float32)
        if want_grad_weight else None,
        grad_bias=torch.zeros(V, device=dev, dtype=torch.float32) if want_grad_bias else None,
    )
    if N == 0:
        return out
    if fused:
        return head_forward_fused(
            out, h_gemm, w, b, y, inv_tau, chunk_size, want_basis=want_basis,
            want_grad_weight=want_grad_weight, want_entropy=want_entropy,
            want_argmax=want_argmax, alpha=alpha, n_valid=n_valid, count=count,
        )

    # a trainable head's recompute with an entropy gradient lands here in the device-counted
    # layout: its count was copied to the host back in the forward, so stop at it
    n_rows = N if count is None else count.get()
    # G is written over Z (see g_over_z), so only the entropy operand E costs a buffer
    C = chunk_size or default_chunk_size(V, int(want_ebasis), w.element_size(), n_rows=N)
    if want_grad_weight and not chunk_size:
        C = max(C, MIN_ROWS_GRAD_WEIGHT)
    C = max(1, min(C, n_rows))
    z_buf = torch.empty(C, V, device=dev, dtype=torch.float32)  # (C, V) fp32 <- the big one
    e_buf = torch.empty(C, V, device=dev, dtype=w.dtype) if want_ebasis else None
    wt = w.t()

    for s, e in chunk_bounds(n_rows, C):
        n = e - s
        z = mm_f32(h_gemm[s:e], wt, out=z_buf[:n])  # (n, V) fp32, no bias / τ yet
        g = g_over_z(z_buf, n, w.dtype) if want_g else None
        eo = e_buf[:n] if want_ebasis else None
        row_softmax(
            z, y[s:e], b, inv_tau,
            g_out=g, e_out=eo,
            alpha=None if alpha is None else alpha[s:e],
            beta=None if beta is None else beta[s:e],
            want_argmax=want_argmax,
            out=(out.lse[s:e], out.z_y[s:e], out.entropy[s:e],
                 out.argmax[s:e] if want_argmax else None),
        )
        if want_basis:
            mm_f32(g, w, out=out.basis[s:e])
        if want_ebasis:
            mm_f32(eo, w, out=out.ebasis[s:e])
        if want_grad_weight:
            accumulate_mm(out.grad_weight, g.t(), h_gemm[s:e])
        if want_grad_bias:
            out.grad_bias += g.float().sum(0)
    if count is not None:
        out.zero_rows_from(n_rows)
    elif n_valid is not None:
        _zero_past(out, n_valid)
    return out


def _basis_buffers(h: torch.Tensor, fused: bool, over_h: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the basis goes: fp32 (unfused); on the fused path (h bf16) split in 3 bytes, its
    bf16 half over h itself when `over_h` (h the call's own copy, read by nothing after its
    chunk's GEMM 1 and flagged rows: no dW), and a uint8 (N, H) half."""
    if not fused:
        return torch.empty(h.shape, device=h.device, dtype=torch.float32), None
    hi = h if over_h else torch.empty_like(h)
    return hi, torch.empty(h.shape, device=h.device, dtype=torch.uint8)


def _zero_past(out: HeadOut, n_valid: torch.Tensor) -> None:
    """Per-row outputs of the rows at or past n_valid set to 0 (argmax −1), as the fused kernels
    write them. dW and db need nothing: those rows' operand G is 0 (zero α and β)."""
    valid = valid_mask(out.lse.shape[0], n_valid)
    for t in (out.lse, out.z_y, out.entropy, out.basis, out.ebasis):
        if t is not None:
            t.mul_(valid.view((-1,) + (1,) * (t.dim() - 1)))
    if out.argmax is not None:
        out.argmax.masked_fill_(~valid, -1)


def g_over_z(z_buf: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The operand G (n, V) in `dtype`, over the bytes of the fp32 Z rows it is computed from.

    Same dtype: Z itself. bf16/fp16: the first half of each fp32 row's bytes, a (n, V) view
    with row stride 2V, which cuBLAS reads as a leading dimension. The row kernel writes G[j]
    only after z[j'] for every j' <= j has been read, so the chunk needs no second (C, V)
    buffer: a 128k-vocabulary row costs 4 V bytes, not 6 V.
    """
    V = z_buf.shape[1]
    if dtype == torch.float32:
        return z_buf[:n]
    return z_buf.view(dtype)[:n, :V]
