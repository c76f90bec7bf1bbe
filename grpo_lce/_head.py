"""The chunk loop shared by linear_logprobs and linear_cross_entropy.

h (N, H), W (V, H), b (V,), y (N,), τ;   z = (h Wᵀ + b) / τ  in chunks of C rows (fp32, never
(N, V)). Ignored rows are compacted away before (grpo_lce._rows), or moved past a device count
`n_valid` and zeroed.

`head_forward` returns lse, z_y, entropy (and argmax) per row and, as a `HeadPass` asks, GEMMs
against the softmax-derived operands G, E of `kernels.row_softmax` while the chunk is still in
memory:
    basis   = G W   (N, H) fp32       with G = α(p − e_y) + β p∘(z − z̄)
    ebasis  = E W   (N, H) fp32       with E = p∘(z − z̄)
    dW     += Gᵀ h  (V, H) fp32       (and db += Σ_rows G)
Which loop runs is the call's `Path` (grpo_lce._dispatch): on the fused path every pass whose
operands the fused kernel computes goes to `head_forward_fused` (below) (same outputs;
entropy only when asked, the basis in 3 bytes a value); the loop below is the reference
algorithm, the one for fp16/fp32, pre-Hopper GPUs and CPU.
Extra memory of the loop below: one chunk, C · V · 4 bytes (G is written over the chunk's own
logits; E, when asked for, takes C · V · 2 more), plus the (N, H) outputs asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from grpo_lce._chunks import (
    MIN_ROWS_GRAD_WEIGHT,
    MIN_ROWS_GRAD_WEIGHT_FUSED,
    chunk_bounds,
    default_chunk_size,
    fused_chunk_size,
)
from grpo_lce._dispatch import Path
from grpo_lce._mm import accumulate_mm, mm_f32
from grpo_lce._rows import HostCount, RowPlan, valid_mask
from grpo_lce.kernels import gemm_rows as gr
from grpo_lce.kernels import gemm_softmax as gs
from grpo_lce.kernels.row_softmax import row_softmax
from grpo_lce.kernels.target_logit import target_logits
from grpo_lce.kernels.target_terms import finish_basis_and_scale_rows, scatter_target


@dataclass(frozen=True)
class HeadRows:
    """The rows a pass runs over, in the call's row layout (grpo_lce._rows)."""

    h: torch.Tensor  # (n, H) hidden states
    y: torch.Tensor  # (n,) int64 targets in [0, V)
    n_valid: torch.Tensor | None = None  # int32 (1,) on the device: rows at or past it are
    # padding (zero h, α = β = 0) and get 0 in every output; None: all rows valid
    count: HostCount | None = None  # n_valid on its way to the host (a trainable head)
    scratch: bool = False  # h is the call's own copy: the fused path may write the basis on it

    @classmethod
    def of(cls, plan: RowPlan, h: torch.Tensor, y: torch.Tensor, *, scratch: bool = False
           ) -> HeadRows:
        return cls(h=h, y=y, n_valid=plan.n_valid, count=plan.count, scratch=scratch)


@dataclass(frozen=True)
class HeadPass:
    """What one pass over the rows computes besides lse and z_y (module docstring)."""

    inv_tau: float = 1.0
    chunk_size: int | None = None  # None: from the memory budget (grpo_lce._chunks)
    basis: bool = False  # G W
    ebasis: bool = False  # E W
    grad_weight: bool = False  # Gᵀ h
    grad_bias: bool = False  # Σ_rows G
    argmax: bool = False
    entropy: bool = True  # (the unfused loop computes it anyway)
    alpha: torch.Tensor | None = None  # (n,) fp32 coefficient of p − e_y in G; None: 1
    beta: torch.Tensor | None = None  # (n,) fp32 coefficient of p∘(z − z̄) in G; None: 0

    @property
    def wants_g(self) -> bool:
        return self.basis or self.grad_weight or self.grad_bias

    @property
    def fusable(self) -> bool:
        """Whether the fused kernel computes what this pass needs: its G' gives α (p − e_y),
        not E, β's term, nor the bias gradient (a sum over the (C, V) operand)."""
        return not (self.ebasis or self.grad_bias or self.beta is not None)


@dataclass
class HeadOut:
    lse: torch.Tensor  # (N,) fp32
    z_y: torch.Tensor  # (N,) fp32
    entropy: torch.Tensor | None  # (N,) fp32; None unless asked for (fused path)
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


@dataclass(frozen=True)
class HeadCall:
    """What every pass of one public call shares: the row plan and the processed rows' targets,
    the head as the caller gave it, the call's Path, 1/τ and the chunk size. `run` is one pass.
    `saved()` / `restored(...)`: the same call without / with its tensors, for an autograd
    Function, whose tensors go through save_for_backward."""

    plan: RowPlan | None
    y: torch.Tensor | None  # (n,) int64 targets of the processed rows
    weight: torch.Tensor | None  # (V, H)
    bias: torch.Tensor | None  # (V,)
    path: Path
    inv_tau: float = 1.0
    chunk_size: int | None = None  # None: from the memory budget (grpo_lce._chunks)

    def run(self, rows: torch.Tensor, *, scratch: bool = False, **spec) -> HeadOut:
        """One pass over `rows` (the processed rows of the plan's layout; `scratch`: the call's
        own copy) computing what the HeadPass fields in `spec` ask for."""
        return head_forward(HeadRows.of(self.plan, rows, self.y, scratch=scratch),
                            gemm_weight(self.weight, self.path.backend), self.bias,
                            HeadPass(inv_tau=self.inv_tau, chunk_size=self.chunk_size, **spec),
                            self.path)

    def saved(self) -> HeadCall:
        return replace(self, plan=None, y=None, weight=None, bias=None)

    def restored(self, plan: RowPlan, y: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> HeadCall:
        return replace(self, plan=plan, y=y, weight=weight, bias=bias)


def gemm_weight(weight: torch.Tensor, backend: str) -> torch.Tensor:
    """The weight as the GEMMs consume it. On CUDA the bf16/fp16 weight itself (cuBLAS writes
    fp32); on CPU, which has no mixed-dtype GEMM, one fp32 copy per call instead of per chunk
    (except under the Triton backend, i.e. the interpreter in tests, whose fused GEMM takes
    bf16 tiles)."""
    if weight.is_cuda or weight.dtype == torch.float32 or backend == "triton":
        return weight
    return weight.float()


def head_forward(rows: HeadRows, w: torch.Tensor, b: torch.Tensor | None, spec: HeadPass,
                 path: Path) -> HeadOut:
    """One pass over rows.h in chunks, as `spec` asks; `w` is `gemm_weight(weight, ...)`.

    Rows at or past rows.n_valid get 0 in every output: the fused path skips their GEMM work;
    the loop below computes and then zeroes them, unless rows.count (the same number on its
    way to the host) lets it stop at them."""
    N, H = rows.h.shape
    V = w.shape[0]
    dev = rows.h.device
    h = rows.h if rows.h.dtype == w.dtype else rows.h.to(w.dtype)
    fused = N > 0 and path.fuses(spec)
    basis, basis_lo = (_basis_buffers(h, fused, rows.scratch and not spec.grad_weight)
                       if spec.basis else (None, None))
    if spec.basis and path.record is not None:
        path.note("basis", (rows.scratch, basis.dtype, None if basis_lo is None else
                            basis_lo.dtype, basis.data_ptr() == rows.h.data_ptr()))
    out = HeadOut(
        lse=torch.empty(N, device=dev, dtype=torch.float32),
        z_y=torch.empty(N, device=dev, dtype=torch.float32),
        entropy=torch.empty(N, device=dev, dtype=torch.float32)
        if spec.entropy or not fused else None,
        argmax=torch.empty(N, device=dev, dtype=torch.int64) if spec.argmax else None,
        basis=basis,
        basis_lo=basis_lo,
        ebasis=torch.empty(N, H, device=dev, dtype=torch.float32) if spec.ebasis else None,
        # the fused loop's first chunk writes dW (no zero fill of V x H fp32 first)
        grad_weight=(torch.empty if fused else torch.zeros)(V, H, device=dev,
                                                             dtype=torch.float32)
        if spec.grad_weight else None,
        grad_bias=torch.zeros(V, device=dev, dtype=torch.float32) if spec.grad_bias else None,
    )
    if N == 0:
        return out
    if fused:
        assert h is rows.h  # the fused path: bf16 rows and weight, the weight as given
        return head_forward_fused(out, rows, w, b, spec, path)

    # a trainable head's recompute with an entropy gradient lands here in the device-counted
    # layout: its count was copied to the host back in the forward, so stop at it
    n_rows = N
    if rows.count is not None:
        n_rows = rows.count.get()
        path.note("count read", n_rows)
    # G is written over Z (see g_over_z), so only the entropy operand E costs a buffer
    C = chunk_rows(spec, V, int(spec.ebasis), w.element_size(), n_size=N, n_rows=n_rows)
    e_buf = torch.empty(C, V, device=dev, dtype=w.dtype) if spec.ebasis else None
    y, alpha, beta = rows.y, spec.alpha, spec.beta

    def softmax_rows(s: int, e: int, z: torch.Tensor, g: torch.Tensor | None) -> None:
        eo = e_buf[:e - s] if spec.ebasis else None
        row_softmax(
            z, y[s:e], b, spec.inv_tau,
            backend=path.backend,
            g_out=g, e_out=eo,
            alpha=None if alpha is None else alpha[s:e],
            beta=None if beta is None else beta[s:e],
            want_argmax=spec.argmax,
            out=(out.lse[s:e], out.z_y[s:e], out.entropy[s:e],
                 out.argmax[s:e] if spec.argmax else None),
        )
        if spec.ebasis:
            mm_f32(eo, w, out=out.ebasis[s:e])

    chunk_loop(h[:n_rows], w, spec, out, C, softmax_rows)
    if rows.count is not None:
        out.zero_rows_from(n_rows)
    elif rows.n_valid is not None:
        _zero_past(out, rows.n_valid)
    return out


def chunk_rows(spec: HeadPass, V: int, n_operands: int, operand_bytes: int, *, n_size: int,
               n_rows: int) -> int:
    """Rows per chunk of `chunk_loop`: spec.chunk_size, or the budget for Z (C, V) fp32 plus
    `n_operands` (C, V) buffers of `operand_bytes` for a call of `n_size` rows (grpo_lce._chunks);
    a dW pass at least MIN_ROWS_GRAD_WEIGHT (its fp32 read-modify-write is paid once a chunk);
    at most the `n_rows` the loop runs over."""
    C = spec.chunk_size or default_chunk_size(V, n_operands, operand_bytes, n_rows=n_size)
    if spec.grad_weight and not spec.chunk_size:
        C = max(C, MIN_ROWS_GRAD_WEIGHT)
    return max(1, min(C, n_rows))


def chunk_loop(h: torch.Tensor, w: torch.Tensor, spec: HeadPass, out, C: int, row_kernel
               ) -> None:
    """The unfused loop over h (n, H) in chunks of C rows, against w (V, H) in h's dtype:

        Z = h Wᵀ (fp32, no bias, no τ) into one reused (C, V) buffer
        row_kernel(s, e, Z, G)   the part that varies: per-row outputs of rows s..e, and the
                                 operand G (C, V) written over Z's bytes when spec.wants_g
        out.basis[s:e] = G W,  out.grad_weight += Gᵀ h,  out.grad_bias += Σ_rows G   (as spec
                                 asks; `out` has those fields)
    """
    n, V = h.shape[0], w.shape[0]
    z_buf = torch.empty(C, V, device=h.device, dtype=torch.float32)  # (C, V) fp32 <- the big one
    wt = w.t()
    for s, e in chunk_bounds(n, C):
        z = mm_f32(h[s:e], wt, out=z_buf[:e - s])  # (n, V) fp32, no bias / τ yet
        g = g_over_z(z_buf, e - s, w.dtype) if spec.wants_g else None
        row_kernel(s, e, z, g)
        if spec.basis:
            mm_f32(g, w, out=out.basis[s:e])
        if spec.grad_weight:
            accumulate_mm(out.grad_weight, g.t(), h[s:e])
        if spec.grad_bias:
            out.grad_bias += g.float().sum(0)


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


# ---- the fused loop: head_forward on the fused path
# head_forward on the fused path: softmax statistics in GEMM 1's epilogue, no fp32 logits.
#
# Per chunk of C rows (see kernels/gemm_softmax.py for the kernel and its precision argument):
#
#     (once per call)     z₂ at the target of every row (kernels/target_logit)
#     GEMM 1 + epilogue   partial (max, Σ2^, Σ2^·z, argmax) per (row, 256 columns) and, for a
#                         gradient, G' = 2^(z₂ − c) in bf16 (C, V), c = z₂_y + SHIFT2
#     reduce              lse, z_y, entropy, argmax; factor_r = α_r 2^(c_r − lse₂_r)
#     flagged rows        G'_r = p_r exactly, factor_r = α_r (usually none; no host sync)
#     GEMM 2              basis = factor ∘ (G' W) − α ∘ W[y]                  = α (p − e_y) W
#     GEMM 3              dW += G'ᵀ (factor ∘ X),  dW[y] −= α ∘ X             = α (p − e_y)ᵀ X
#
# Rows: with `n_valid` (an int32 device tensor, the device-counted layout of grpo_lce._rows) every
# kernel reads the number of valid rows and skips the row blocks past it, and GEMMs 2 and 3 are the
# Triton kernels of kernels/gemm_rows (GEMM 2 split along V to fill the GPU, GEMM 3's K loop
# stopping at the count). When the count is known on the host, GEMMs 2 and 3 are cuBLAS instead
# (faster at the chunk sizes the loop uses): without `n_valid` (all rows valid, counted on the
# host), or with `count` (a trainable head in the device-counted layout: grpo_lce._rows.HostCount),
# read once chunk 0's GEMM 1 and reduction are queued, so that the GPU has work while the host
# waits for the copy; the chunks past the count are then skipped.
#
# Compared with the unfused loop (fp32 Z written by GEMM 1, read twice by the row kernel, G written
# over it) this moves C · V · 10 bytes less per chunk and writes the operand of GEMM 2 directly.
# Memory: G' (C, V) in bf16 (half the unfused fp32 chunk) and the partials, C · T · 4 bytes per
# statistic kept (2 to 5 of them; T = V / 128 partials a row with G', V / 256 without). Without a
# gradient, no (C, V) buffer at all: the chunk then only bounds the partials.
#
# The basis (N, H) is kept in 3 bytes a value (kernels/split_float: a bf16 array and a uint8
# one, fp32 truncated to 15 mantissa bits, < 2^-15 relative): GEMM 2 sums and the target term is
# subtracted in fp32 (the cancellation between p W and W[y] of a confident row happens there),
# and dh = g · basis is then rounded to bf16 once, as from fp32. With `rows.scratch` (h is a copy
# the call owns: the rows gathered into the device-counted layout) and no dW, chunk i's bf16 half
# is written over chunk i's rows of h once its GEMM 1 and flagged rows have read them (the target
# logits read every row before the loop; later chunks read only later rows): the forward then
# holds h, the uint8 half, G' and the partials, 3 N H bytes where the rows and an fp32 basis
# took 6 (llama-8b's 16384 x 4096 case: 192 MiB less).
# Which passes come here is decided by grpo_lce._dispatch (`Path.fuses`): the entropy-gradient
# operand p ∘ (z − z̄), a trainable bias, fp16/fp32 and pre-Hopper GPUs take
# the unfused loop of `head_forward`, which stays the reference algorithm (and the CPU one).

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
