"""The decode step's reductions over the vocabulary, split over programs: the log-sum-exp, the
exponential race (or the argmax) and the drawn token's log-prob (`race_sample`).

For processed logits z (B, V) fp32 (-inf where truncated, the largest finite) and, when
sampling, Exp(1) draws E (B, V) fp32 (torch's `exponential_`, the draws `processors.sample`
makes):

    lse_b  = log Σ_j exp(z_bj)
    y_b    = argmax_j (z_bj − lse_b) − log max(E_bj, 1e-30)     sampling: the exponential race
             argmax_j z_bj                                      greedy
    logp_b = z_b,y − lse_b

ties to the first index, as `torch.argmax`. Three launches over (B, S) chunks of BLOCK tokens:
each chunk's max m and Σ exp(z − m); each chunk's best candidate under lse_b = M + log Σ_i
s_i · exp(m_i − M) (M = max_i m_i); one program per row picks among its S candidates.
`processors.sample` computes the same quantities with one program per row (torch's softmax and
argmax), which at a decode batch leaves most of the GPU idle.

Precision: lse differs from torch's log_softmax only by the order of the fp32 sums (and the
exp's few ulps): |Δ lse| ≤ (V + S + 4) · 2⁻²⁴ + ulp(lse), so logp is within that plus
ulp(logp) of the exact fp64 value (tests/test_sampling_race.py). The race's scores are
(z − lse) − log E with libdevice's logf on the GPU (torch's log), where torch forms
((z − max) − log Σ) − log E: the same up to that bound, so the token is torch's except where
two scores are within it of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._interp import interpreting
from .pdl import grid_wait, launch_args

BLOCK = 4096  # tokens per chunk (one program)


@triton.jit
def _chunk_lse_kernel(z_ptr, m_ptr, s_ptr, V, S, stride_z, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """Chunk c of row b: m = max z, s = Σ exp(z − m) (0 for a chunk of -inf only)."""
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(z_ptr + b.to(tl.int64) * stride_z + offs, mask=offs < V, other=float("-inf"))
    m = tl.max(z, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)  # exp(-inf) = 0, never -inf − -inf
    s = tl.sum(tl.exp(z - shift), 0)
    tl.store(m_ptr + b * S + c, m)
    tl.store(s_ptr + b * S + c, s)


@triton.jit
def _row_lse(m_ptr, s_ptr, b, S, S_BLOCK: tl.constexpr):
    """lse of row b from its S chunks' (m, s): M + log Σ s_i · exp(m_i − M)."""
    offs = tl.arange(0, S_BLOCK)
    ok = offs < S
    m = tl.load(m_ptr + b * S + offs, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + b * S + offs, mask=ok, other=0.0)
    big = tl.max(m, 0)  # finite: every row holds a finite logit
    return big + tl.log(tl.sum(s * tl.exp(m - big), 0))


@triton.jit
def _chunk_race_kernel(z_ptr, e_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, V, S, stride_z, stride_e,
                       SAMPLE: tl.constexpr, BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                       PDL: tl.constexpr, INTERP: tl.constexpr):
    """Chunk c of row b: its best score and the score's token (the first among ties)."""
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    z = tl.load(z_ptr + b.to(tl.int64) * stride_z + offs, mask=ok, other=float("-inf"))
    if SAMPLE:
        lse = _row_lse(m_ptr, s_ptr, b, S, S_BLOCK)
        e = tl.maximum(tl.load(e_ptr + b.to(tl.int64) * stride_e + offs, mask=ok, other=1.0),
                       1e-30)
        if INTERP:  # the interpreter has no libdevice: numpy's log
            log_e = tl.log(e)
        else:  # logf, as torch's log
            log_e = libdevice.log(e)
        score = tl.where(ok, (z - lse) - log_e, float("-inf"))
    else:
        score = z
    best, i = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + b * S + c, best)
    tl.store(idx_ptr + b * S + c, c * BLOCK + i)


@triton.jit
def _pick_kernel(z_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, y_ptr, lp_ptr, S, stride_z,
                 S_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row b: the best of its S chunk candidates (the first chunk among ties: the first index),
    its token and z_y − lse."""
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    b = tl.program_id(0)
    offs = tl.arange(0, S_BLOCK)
    ok = offs < S
    best = tl.load(best_ptr + b * S + offs, mask=ok, other=float("-inf"))
    _, c = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    y = tl.load(idx_ptr + b * S + c)
    lse = _row_lse(m_ptr, s_ptr, b, S, S_BLOCK)
    tl.store(y_ptr + b, y.to(tl.int64))
    tl.store(lp_ptr + b, tl.load(z_ptr + b.to(tl.int64) * stride_z + y) - lse)


def race_sample(z: torch.Tensor, draws: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (B,) int64, logp (B,) fp32) of the module docstring for z (B, V) fp32; `draws` (B, V)
    fp32 Exp(1) for sampling, None for greedy."""
    if z.dim() != 2 or z.dtype != torch.float32:
        raise ValueError(f"z has shape {tuple(z.shape)} {z.dtype}, expected (B, V) float32")
    if draws is not None and (draws.shape != z.shape or draws.dtype != torch.float32):
        raise ValueError(f"draws has shape {tuple(draws.shape)} {draws.dtype}, expected "
                         f"{tuple(z.shape)} float32")
    z = z if z.stride(1) == 1 else z.contiguous()
    B, V = z.shape
    S = triton.cdiv(V, BLOCK)
    sb = max(2, triton.next_power_of_2(S))
    dev = z.device
    m, s, best = (torch.empty(B, S, device=dev, dtype=torch.float32) for _ in range(3))
    idx = torch.empty(B, S, device=dev, dtype=torch.int32)
    y = torch.empty(B, device=dev, dtype=torch.int64)
    lp = torch.empty(B, device=dev, dtype=torch.float32)
    sample = draws is not None
    if sample:
        draws = draws if draws.stride(1) == 1 else draws.contiguous()
    _chunk_lse_kernel[(B, S)](z, m, s, V, S, z.stride(0), BLOCK=BLOCK, num_warps=8,
                              **launch_args(_chunk_lse_kernel, dev))
    _chunk_race_kernel[(B, S)](z, draws if sample else z, m, s, best, idx, V, S, z.stride(0),
                               draws.stride(0) if sample else 0, SAMPLE=sample, BLOCK=BLOCK,
                               S_BLOCK=sb, INTERP=interpreting(), num_warps=8,
                               **launch_args(_chunk_race_kernel, dev))
    _pick_kernel[(B,)](z, m, s, best, idx, y, lp, S, z.stride(0), S_BLOCK=sb, num_warps=1,
                       **launch_args(_pick_kernel, dev))
    return y, lp
