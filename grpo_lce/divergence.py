"""linear_divergence: the divergence between a student's and a teacher's next-token distributions
over the full vocabulary, from both models' hidden states and LM heads, without (N, V) logits.

h (N, Hs), W (V, Hs), b (V,) the student;  g (N, Ht), U (V, Ht), c (V,) the teacher;  τ;  β ∈ [0, 1]
    s = (h Wᵀ + b) / τ,   t = (g Uᵀ + c) / τ         chunks of C rows, fp32 (accumulated and kept)
    p = softmax(s),  q = softmax(t)
    β = 0:     D = KL(q‖p)                             ∂D/∂s = p − q           (forward KL)
    β = 1:     D = KL(p‖q)                             ∂D/∂s = p ∘ (log p − log q − D)
    0 < β < 1: D = β KL(q‖m) + (1−β) KL(p‖m),  m = (1−β) p + β q
                                                       ∂D/∂s = (1−β) p ∘ (log p − log m − KL(p‖m))
    H = −Σ p log p                                     the student's entropy (a metric: no gradient)
    ∂D/∂h = (∂D/∂s / τ) W                              (N, Hs): the gradient basis

These are TRL 1.16's definitions (`trl.kernels.chunked_divergence`, the DistillationTrainer's
`beta`), per token, unreduced. Only the student gets a gradient; the teacher's inputs are
constants. Hs and Ht may differ; V may not. The row math and its precision argument are in
grpo_lce/kernels/divergence_rows.py.

Two implementations, one switch: `method=`.

  "basis" (the default)  per chunk, GEMMs S = h Wᵀ and T = g Uᵀ into two fp32 (C, V) buffers;
      the row kernel (kernels/divergence_rows: Triton on CUDA, torch ops elsewhere) writes D, H
      and G = ∂D/∂s / τ over S's own bytes (in the GEMM dtype). A frozen student head (LoRA,
      QLoRA) then builds basis = G W (C, Hs) in the same chunk, and the backward is elementwise,
      dh_n = ḡ_n · basis_n for any upstream gradient ḡ: 3 GEMMs in all. A trainable head or bias:
      the forward keeps D and H only (2 GEMMs); the backward recomputes each chunk with G scaled
      by ḡ_n / τ, giving dh = G W, dW = Gᵀ h, db = Σ_rows G (4 GEMMs).
  "chunked"  `grpo_lce.chunked_linear` with a plain-torch function of the student's logits chunk
      that computes the teacher's chunk itself (g's rows as a row argument, U from a closure)
      and D in differentiable torch; autograd differentiates it in the backward. Forward 2 GEMMs,
      backward 2 + dX (+ dW): 5 GEMMs frozen, 6 trainable. No derivative is written by hand: the
      cross-check of "basis", and the other side of an A/B timing.

Extra memory of a call, beyond inputs and outputs: "basis" holds two fp32 (C, V) buffers (plus,
on the torch row path, the row ops' (C, V) temporaries, which the default chunk size counts) and
keeps the fp32 basis (n, Hs) of the n unmasked rows for a frozen head, nothing else (not h, not
g); a trainable head keeps h and g for its recompute. "chunked" holds one chunk's logits and the
autograd graph of the row function (about eight (C, V) fp32 tensors). Rows whose `mask` is 0 are
dropped before any GEMM (one host read a call: their number sizes the GEMMs) and get 0 in every
output and gradient.

Standalone, as a benchmark calls it (shapes of a Llama-3.2-1B student and 3B teacher):

    import torch
    from grpo_lce import linear_divergence
    N, Hs, Ht, V = 8192, 2048, 3072, 128256
    kw = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.randn(N, Hs, **kw, requires_grad=True)      # student hidden states
    W = torch.randn(V, Hs, **kw) * Hs**-0.5               # student lm_head.weight (frozen)
    g = torch.randn(N, Ht, **kw)                          # teacher hidden states
    U = torch.randn(V, Ht, **kw) * Ht**-0.5               # teacher lm_head.weight
    mask = torch.ones(N, dtype=torch.bool, device="cuda") # 0: an ignored position
    d = linear_divergence(h, W, g, U, beta=0.5, temperature=1.0, mask=mask,
                          method="basis")                 # or method="chunked"; (N,) fp32
    d.sum().backward()

The same inputs for the others: TRL's kernel is
`trl.kernels.chunked_divergence.ChunkedDivergenceFunction.apply(h, W, None, g, U, None, beta,
temperature)` → (D (N,), entropy (N,)), on the rows it is given (TRL drops masked rows first);
Liger's is `liger_kernel.chunked_loss.LigerFusedLinearJSDLoss(weight_hard_loss=0.0,
weight_soft_loss=1.0, beta=beta, temperature=temperature)(h, W, g, U, labels)` → a scalar
averaged over the labels ≠ -100 (same β convention; its logits chunks are in the input dtype,
i.e. rounded to bf16, before its fp32 log_softmax). TRL 1.16 keeps its logit tiles in fp32
(torch.mm with an fp32 output) and rounds the gradient tile to the input dtype before the dh GEMM,
as "basis" rounds G; it forms the forward KL and the entropy as differences of running sums
near the row max (a confident row's entropy loses its digits: tests/test_divergence.py), and
runs 2 GEMMs forward for a KL, 4 for the JSD (its second pass recomputes both projections),
and 3 backward (4 with dW).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_lce._checks import check_chunk_size, check_head, check_temperature
from grpo_lce._chunks import MIN_ROWS_GRAD_WEIGHT, chunk_bounds, default_chunk_size
from grpo_lce._dispatch import decide
from grpo_lce._head import g_over_z, gemm_weight
from grpo_lce._mm import accumulate_mm, mm_f32
from grpo_lce.chunked import chunked_linear
from grpo_lce.kernels.divergence_rows import divergence_mode, divergence_rows

METHODS = ("basis", "chunked")

# (C, V) fp32 buffers a chunk row costs besides S: T on the Triton path; on the torch path also
# the row ops' temporaries (log p, log q, p, q, log m and a product, at their peak).
_EXTRA_ROWS = {"triton": 1, "torch": 7}
# "chunked": the logits chunk and the autograd graph of `_divergence_autograd` for it.
_CHUNKED_ROWS = 8


@dataclass
class _PassOut:
    d: torch.Tensor  # (n,) fp32
    entropy: torch.Tensor  # (n,) fp32
    basis: torch.Tensor | None = None  # (n, Hs) fp32: G W (frozen head), or dh (recompute)
    grad_weight: torch.Tensor | None = None  # (V, Hs) fp32: Gᵀ h
    grad_bias: torch.Tensor | None = None  # (V,) fp32: Σ_rows G


def _divergence_pass(h, w, b, g, u, c, beta, inv_tau, chunk_size, backend, *, basis=False,
                     grad_weight=False, grad_bias=False, g_scale=None) -> _PassOut:
    """One pass over the rows h (n, Hs), g (n, Ht) in chunks ("basis", module docstring).
    G = g_scale_n / τ · ∂D/∂s (g_scale None: 1) feeds the GEMMs asked for."""
    n, Hs = h.shape
    V = w.shape[0]
    dev = h.device
    ws, wt = gemm_weight(w, backend), gemm_weight(u, backend)
    # on CPU a bf16 head's GEMMs run on an fp32 copy (gemm_weight): the rows follow, once
    h = h if h.dtype == ws.dtype else h.to(ws.dtype)
    g = g if g.dtype == wt.dtype else g.to(wt.dtype)
    out = _PassOut(
        d=torch.empty(n, device=dev, dtype=torch.float32),
        entropy=torch.empty(n, device=dev, dtype=torch.float32),
        basis=torch.empty(n, Hs, device=dev, dtype=torch.float32) if basis else None,
        grad_weight=torch.zeros(V, Hs, device=dev, dtype=torch.float32) if grad_weight else None,
        grad_bias=torch.zeros(V, device=dev, dtype=torch.float32) if grad_bias else None,
    )
    if n == 0:
        return out
    want_g = basis or grad_weight or grad_bias
    C = chunk_size or default_chunk_size(V, _EXTRA_ROWS[backend], 4, n_rows=n)
    if grad_weight and not chunk_size:
        C = max(C, MIN_ROWS_GRAD_WEIGHT)  # dW's fp32 read-modify-write is paid once per chunk
    C = max(1, min(C, n))
    s_buf = torch.empty(C, V, device=dev, dtype=torch.float32)  # (C, V) fp32 <- the big ones
    t_buf = torch.empty(C, V, device=dev, dtype=torch.float32)
    for s0, e0 in chunk_bounds(n, C):
        k = e0 - s0
        S = mm_f32(h[s0:e0], ws.t(), out=s_buf[:k])  # no bias, no τ: the row kernel adds them
        T = mm_f32(g[s0:e0], wt.t(), out=t_buf[:k])
        # G in the GEMM dtype over S's own bytes (bf16: the first half of each fp32 row)
        G = g_over_z(s_buf, k, ws.dtype) if want_g else None
        divergence_rows(S, T, b, c, inv_tau, beta, backend=backend, g_out=G, g_mul=inv_tau,
                        g_scale=None if g_scale is None else g_scale[s0:e0],
                        out=(out.d[s0:e0], out.entropy[s0:e0]))
        if basis:
            mm_f32(G, ws, out=out.basis[s0:e0])
        if grad_weight:
            accumulate_mm(out.grad_weight, G.t(), h[s0:e0])
        if grad_bias:
            out.grad_bias += G.float().sum(0)
    return out


class _LinearDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, g, u, c, beta, inv_tau, chunk_size, backend, frozen_basis,
                recompute):
        # h (n, Hs), g (n, Ht): the unmasked rows; frozen_basis: build dh's basis now (a frozen
        # head whose hidden states need a gradient); recompute: a trainable weight or bias
        out = _divergence_pass(h, w, b, g, u, c, beta, inv_tau, chunk_size, backend,
                               basis=frozen_basis)
        ctx.beta, ctx.inv_tau, ctx.chunk_size, ctx.backend = beta, inv_tau, chunk_size, backend
        ctx.recompute, ctx.hidden_dtype = recompute, h.dtype
        if recompute:
            ctx.save_for_backward(h, w, b, g, u, c)
        else:  # the frozen head needs only the basis: h, g and the weights can be freed
            ctx.save_for_backward(out.basis)
        ctx.mark_non_differentiable(out.entropy)
        ctx.set_materialize_grads(False)
        return out.d, out.entropy

    @staticmethod
    def backward(ctx, g_d, _g_entropy):
        none = (None,) * 9
        if g_d is None:
            return (None, None, None) + none
        if not ctx.recompute:
            (basis,) = ctx.saved_tensors
            if basis is None:
                return (None, None, None) + none
            # dh_n = ḡ_n · basis_n, rounded to the hidden dtype once
            return (basis * g_d.float()[:, None]).to(ctx.hidden_dtype), None, None, *none
        h, w, b, g, u, c = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        out = _divergence_pass(h, w, b, g, u, c, ctx.beta, ctx.inv_tau, ctx.chunk_size,
                               ctx.backend, basis=need_h, grad_weight=need_w, grad_bias=need_b,
                               g_scale=g_d.float())
        return (out.basis.to(h.dtype) if need_h else None,
                out.grad_weight.to(w.dtype) if need_w else None,
                out.grad_bias.to(b.dtype) if need_b else None, *none)


def _divergence_autograd(s: torch.Tensor, t: torch.Tensor, beta: float):
    """(D, H) per row of the scaled logits s, t (C, V) fp32, in differentiable torch ops."""
    # z − logsumexp(z), not torch.log_softmax: on CPU its fp32 row sum drifts (8e-6 in every
    # log-prob at V = 128256, 10× logsumexp's error)
    lp = s - torch.logsumexp(s, -1, keepdim=True)
    lq = t - torch.logsumexp(t, -1, keepdim=True)
    p = lp.exp()
    mode = divergence_mode(beta)
    if mode == 0:
        d = (lq.exp() * (lq - lp)).sum(-1)
    elif mode == 1:
        d = (p * (lp - lq)).sum(-1)
    else:
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        d = beta * (lq.exp() * (lq - lm)).sum(-1) + (1.0 - beta) * (p * (lp - lm)).sum(-1)
    return d, -(p * lp).sum(-1)


def _chunked(h, w, b, g, u, c, beta, inv_tau, chunk_size, backend):
    """"chunked" (module docstring): D and H of the rows through `chunked_linear`."""
    if b is not None and b.requires_grad and torch.is_grad_enabled():
        raise ValueError("method='chunked' cannot train student_bias (chunked_linear takes no "
                         "bias); use method='basis'")
    ut = gemm_weight(u, backend).t()
    bs = None if b is None else b.detach().float()
    bt = None if c is None else c.float()

    def fn(z, g_rows):
        s = (z if bs is None else z + bs) * inv_tau
        t = mm_f32(g_rows, ut)  # (C, V) fp32: the teacher's chunk, a constant for autograd
        t = (t if bt is None else t + bt) * inv_tau
        d, ent = _divergence_autograd(s, t, beta)
        return torch.stack([d, ent.detach()], 1)

    n = h.shape[0]
    if n == 0:  # (chunked_linear's empty result has no graph: this one is h's, as "basis"'s)
        return h.float().sum(-1), h.new_zeros(0, dtype=torch.float32)
    chunk = chunk_size or default_chunk_size(w.shape[0], _CHUNKED_ROWS - 1, 4, n_rows=n)
    out = chunked_linear(fn, h, w, g, chunk_size=chunk)  # (n, 2)
    return out[:, 0], out[:, 1].detach()


def _check_pair(who: str, hidden, weight, bias) -> None:
    """grpo_lce._checks.check_head, its message prefixed with whose head it is."""
    try:
        check_head(hidden, weight, bias)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{who}: {e}") from None


def linear_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float,
    mask: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    method: str = "basis",
):
    """Per-token divergence between the student's and the teacher's softmax((h @ W.T + b) / τ).

    Equals, in fp32 from logits accumulated in fp32 (never rounded to the input dtype),
    ``D = KL(q‖p)`` (β = 0), ``KL(p‖q)`` (β = 1) or ``β KL(q‖m) + (1−β) KL(p‖m)`` with
    ``m = (1−β) p + β q``, p the student's and q the teacher's distribution: TRL 1.16's
    generalized JSD. No (N, V) logits of either model are allocated.

    Args:
        student_hidden: (..., Hs) float32 / bfloat16 / float16.
        student_weight: (V, Hs), student_hidden's dtype and device.
        teacher_hidden: (..., Ht), student_hidden's leading shape; its own dtype.
        teacher_weight: (V, Ht), teacher_hidden's dtype; same V and device as the student's.
        beta: in [0, 1]; 0 is the forward KL, 1 the reverse KL, anything between the JSD.
        mask: (...) the leading shape, nonzero where the token counts; 0 gives 0 in every
            output and gradient, at no GEMM cost. None keeps every row.
        student_bias, teacher_bias: optional (V,), each in its head's dtype.
        temperature: > 0; both models' logits are divided by it.
        return_entropy: also return the student's per-token entropy (fp32, no gradient).
        chunk_size: rows per chunk; any positive int (default: a 256 MiB budget for the chunk's
            (C, V) buffers, see the module docstring).
        method: "basis" (default) or "chunked": the two implementations of the module docstring.

    Returns:
        D (...) fp32, or (D, entropy) when `return_entropy`. Differentiable with respect to
        student_hidden, student_weight and student_bias for any upstream gradient; the teacher's
        tensors get none.

    One host read a call when `mask` is given (the number of unmasked rows).
    """
    _check_pair("student", student_hidden, student_weight, student_bias)
    _check_pair("teacher", teacher_hidden, teacher_weight, teacher_bias)
    lead = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(
            f"teacher_hidden has leading shape {tuple(teacher_hidden.shape[:-1])} but "
            f"student_hidden has {lead} (shapes {tuple(teacher_hidden.shape)} and "
            f"{tuple(student_hidden.shape)})"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight has V={teacher_weight.shape[0]} but student_weight has "
            f"V={student_weight.shape[0]}: the divergence needs one vocabulary"
        )
    if teacher_weight.device != student_weight.device:
        raise ValueError(f"teacher_weight is on {teacher_weight.device} but student_weight is "
                         f"on {student_weight.device}")
    if isinstance(beta, torch.Tensor) or not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be a float in [0, 1], got {beta!r}")
    beta = float(beta)
    inv_tau = 1.0 / check_temperature(temperature)
    check_chunk_size(chunk_size)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    h = student_hidden.reshape(-1, student_hidden.shape[-1])
    g = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    u = teacher_weight.detach()
    c = None if teacher_bias is None else teacher_bias.detach()
    N = h.shape[0]
    idx = None
    if mask is not None:
        if tuple(mask.shape) != lead:
            raise ValueError(f"mask has shape {tuple(mask.shape)} but the hidden states have "
                             f"leading shape {lead}")
        if mask.device != h.device:
            raise ValueError(f"mask is on {mask.device} but student_hidden is on {h.device}")
        keep = mask.reshape(-1) != 0
        n_keep = int(keep.sum())  # the host read: it sizes every GEMM below
        if n_keep < N:
            idx = torch.nonzero_static(keep, size=n_keep).squeeze(1)
            h, g = h.index_select(0, idx), g.index_select(0, idx)

    backend = decide(h, student_weight, student_bias).backend
    if method == "chunked":
        d, ent = _chunked(h, student_weight, student_bias, g, u, c, beta, inv_tau, chunk_size,
                          backend)
    else:
        grad = torch.is_grad_enabled()
        recompute = grad and (student_weight.requires_grad
                              or (student_bias is not None and student_bias.requires_grad))
        frozen_basis = grad and h.requires_grad and not recompute
        d, ent = _LinearDivergence.apply(h, student_weight, student_bias, g, u, c, beta, inv_tau,
                                         chunk_size, backend, frozen_basis, recompute)
    if idx is not None:
        # back to the caller's rows; index_copy's backward hands each row its own gradient
        d = d.new_zeros(N).index_copy(0, idx, d)
        ent = ent.new_zeros(N).index_copy(0, idx, ent)
    d, ent = d.reshape(lead), ent.reshape(lead)
    return (d, ent) if return_entropy else d
