"""chunked_linear: any torch function of the logits, f(X Wᵀ), chunk by chunk, with autograd.

X (N, H), W (V, H), row_args r_i (N, ...);   out = f(X_c Wᵀ, r_1[c], r_2[c], ...) per chunk c
    per-row f  (returns (C, ...)):  out = cat_c f(...)          (N, ...)
    scalar f   (returns 0-d):       out = Σ_c f(...)            0-d, f must sum over its rows

The forward runs each chunk under no_grad and keeps nothing but X, W and the outputs. The
backward recomputes each chunk with grad enabled and lets autograd differentiate f itself,
seeded with the upstream gradient of that chunk's outputs:
    dX_c = ∂⟨ḡ_c, f(X_c Wᵀ)⟩/∂X_c,    dW = Σ_c ∂⟨ḡ_c, f(X_c Wᵀ)⟩/∂W
No derivative of f is written by hand. The logits of a chunk are fp32 (X_c Wᵀ accumulated and
returned in fp32). Extra memory: a chunk of logits plus whatever f's autograd graph keeps for
one chunk; 2 forward GEMMs' worth of compute plus f's backward (3 GEMMs in all, 4 with dW).
row_args are constants for autograd (teacher distributions, targets, advantages): detach them.
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo_lce._checks import check_chunk_size, check_head
from grpo_lce._chunks import chunk_bounds, default_chunk_size
from grpo_lce._dispatch import decide
from grpo_lce._head import gemm_weight
from grpo_lce._mm import mm_f32


def _logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (C, H) @ w (V, H)ᵀ in fp32; differentiable (autograd sees an fp32 matmul)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return x.float() @ w.float().t()
    return mm_f32(x, w.t())


class _ChunkedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk, backend, x, w, *row_args):
        N = x.shape[0]
        gw = gemm_weight(w, backend)
        outs = []
        scalar = None
        for s, e in chunk_bounds(N, chunk):
            o = fn(_logits(x[s:e], gw), *(r[s:e] for r in row_args))
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"fn must return a tensor, got {type(o).__name__}")
            is_scalar = o.dim() == 0
            if scalar is None:
                scalar = is_scalar
            if is_scalar != scalar or (not is_scalar and o.shape[0] != e - s):
                raise ValueError(
                    "fn must return either a 0-d tensor (summed over rows) on every chunk or a "
                    f"per-row tensor of leading size = chunk rows; got shape {tuple(o.shape)} "
                    f"for a chunk of {e - s} rows"
                )
            outs.append(o)
        ctx.fn, ctx.chunk, ctx.scalar = fn, chunk, scalar
        ctx.save_for_backward(x, w, *row_args)
        if scalar:
            return torch.stack(outs).sum()
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, g_out):
        x, w, *row_args = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(w.shape, device=w.device, dtype=torch.float32) if need_w else None
        w_leaf = w.detach().requires_grad_(need_w)
        for s, e in chunk_bounds(x.shape[0], ctx.chunk):
            x_c = x[s:e].detach().requires_grad_(need_x)
            with torch.enable_grad():
                o = ctx.fn(_logits(x_c, w_leaf), *(r[s:e] for r in row_args))
                g = g_out if ctx.scalar else g_out[s:e]
                inputs = [t for t, need in ((x_c, need_x), (w_leaf, need_w)) if need]
                grads = torch.autograd.grad(o, inputs, g, allow_unused=True)
            grads = list(grads)
            if need_x:
                gx = grads.pop(0)
                dx[s:e] = 0 if gx is None else gx
            if need_w:
                gw = grads.pop(0)
                if gw is not None:
                    dw += gw
        return (None, None, None, dx, None if dw is None else dw.to(w.dtype),
                *([None] * len(row_args)))


def chunked_linear(
    fn: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *row_args: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``fn(hidden @ weight.T, *row_args)`` evaluated chunk by chunk, never holding all logits.

    `fn(logits_chunk, *row_args_chunk)` receives fp32 logits (C, V) and the matching rows of
    each row_arg, and returns either per-row outputs (C, ...) or a 0-d tensor that sums over
    its rows. hidden (..., H) is flattened to rows; each row_arg must have the same leading
    shape and is flattened alike; per-row outputs come back with hidden's leading shape.
    Differentiable with respect to hidden and weight through autograd of `fn` itself.
    chunk_size: rows per chunk, any positive int (default: a 256 MiB fp32 logits budget).
    """
    check_head(hidden, weight, None)
    check_chunk_size(chunk_size)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    lead = hidden.shape[:-1]
    x = hidden.reshape(-1, hidden.shape[-1])
    rows = []
    for i, r in enumerate(row_args):
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"row_args[{i}] must be a tensor, got {type(r).__name__}")
        if tuple(r.shape[: len(lead)]) != tuple(lead):
            raise ValueError(
                f"row_args[{i}] has shape {tuple(r.shape)}; its leading dims must equal "
                f"hidden's {tuple(lead)}"
            )
        if r.device != hidden.device:
            raise ValueError(f"row_args[{i}] is on {r.device} but hidden is on {hidden.device}")
        rows.append(r.detach().reshape(x.shape[0], *r.shape[len(lead):]))
    n = x.shape[0]
    chunk = chunk_size or default_chunk_size(weight.shape[0], n_operands=0, n_rows=n)
    chunk = min(chunk, max(n, 1))
    if n == 0:
        probe = fn(torch.zeros(0, weight.shape[0], device=x.device), *rows)
        if probe.is_floating_point() and torch.is_grad_enabled() and (
                hidden.requires_grad or weight.requires_grad):
            # Σ over no elements is exactly 0: the result keeps its values and gains a graph
            # to both inputs, so backward gives them zero gradients instead of failing
            probe = probe + (x.sum() + weight.reshape(-1)[:0].sum()).to(probe.dtype)
        return probe.reshape(*lead, *probe.shape[1:]) if probe.dim() else probe
    # (only the backend matters here: the weight's fp32 copy on CPU, see gemm_weight)
    out = _ChunkedLinear.apply(fn, chunk, decide(x, weight).backend, x, weight, *rows)
    return out if out.dim() == 0 else out.reshape(*lead, *out.shape[1:])
