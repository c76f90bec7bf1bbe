"""Tolerance helpers: ours and plain torch in the test dtype, both against fp64 (three-way); two
fp32 runs against the fp64 run of one of them; rounding bounds from sum lengths and magnitudes.

`GRPO_LCE_TOLERANCE_LOG=path` appends one line per comparison made here (what, error, bound),
for reading how much of each bound a machine uses.
"""

import contextlib
import math
import os
import sys

import torch

# The fused path (test_gemm_softmax, test_device_rows): values come from fp32 logits on both
# paths (1e-6 at those sizes); gradients from a bf16 operand (2^-8 relative) returned in bf16:
# 1e-2 of the gradient's scale.
FUSED_VALUE_ATOL = 5e-5
FUSED_GRAD_RTOL = 1e-2


def _log(what: str, err: float, bound: float) -> None:
    path = os.environ.get("GRPO_LCE_TOLERANCE_LOG")
    if path:
        with open(path, "a") as f:
            ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            f.write(f"{ratio:.3e}\t{err:.3e}\t{bound:.3e}\t{test}\t{what}\n")


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def assert_3way(ours, torch_same, ref, *, k: float, atol: float, what: str) -> None:
    """err(ours vs fp64) <= k * err(torch in the same dtype vs fp64) + atol; worst element shown."""
    e_ours = max_err(ours, ref)
    e_torch = max_err(torch_same, ref) if torch_same is not None else 0.0
    bound = k * e_torch + atol
    _log(what, e_ours, bound)
    if not e_ours <= bound:
        diff = (ours.double() - ref.double()).abs()
        i = int(diff.reshape(-1).argmax())
        raise AssertionError(
            f"{what}: max |ours - fp64| = {e_ours:.3e} > {k} * {e_torch:.3e} + {atol:.1e}; "
            f"worst flat index {i}: ours {ours.reshape(-1)[i].item():.8g}, "
            f"fp64 {ref.reshape(-1)[i].item():.8g}"
        )


def assert_close_scaled(ours, ref, *, rtol: float, what: str) -> None:
    """max |ours - ref| <= rtol * max |ref| (+ tiny floor): for gradients whose scale varies."""
    scale = max(ref.double().abs().max().item(), 1e-12) if ref.numel() else 1.0
    e = max_err(ours, ref)
    _log(what, e, rtol * scale + 1e-12)
    if not e <= rtol * scale + 1e-12:
        diff = (ours.double() - ref.double()).abs()
        i = int(diff.reshape(-1).argmax())
        raise AssertionError(
            f"{what}: max err {e:.3e} > {rtol} * max|ref| {scale:.3e}; worst flat index {i}: "
            f"ours {ours.reshape(-1)[i].item():.8g}, ref {ref.reshape(-1)[i].item():.8g}"
        )


# ---------------------------------------------------------------- two fp32 runs against fp64

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: one ulp at 1

# Ours and stock TRL (or one process and two) compute the same quantity in fp32 with different
# summation orders: each one's distance to fp64 is a sum of roundings of one distribution, and
# ||ours - fp64|| <= ||stock - fp64|| + ||ours - stock||, the last ~sqrt(2) such errors for
# independent roundings (1 + sqrt(2) = 2.4): k = 3. Norms over a tensor, not its max element:
# the max of n errors is too noisy a statistic for a ratio.
# This scales with whatever the depth of the backward and the lengths of its sums make stock's
# own error, on every machine, where a fixed rtol x max|ref| holds on one BLAS build only.
K_REORDERED = 3.0


def fused_head_torch(hidden, weight, bias, targets, temperature, final_logit_softcapping=None,
                     logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits",
                                                "is_top1")):
    """What TRL's fused head (`trl.kernels.chunked_logprob.ChunkedLogProbFunction`) returns,
    (log p_y, entropy, log Σ p², mean logit, is_top1), None where not in `outputs`, in plain
    autograd ops in the inputs' dtype (the (N, V) logits materialized: tests' sizes only):

        z = _torch_transform(h Wᵀ + b) = (softcap · tanh(s z / softcap) or s z) · (1 / τ)
        log p_y = z_y − lse;  entropy = lse − Σ p z;  log Σ p² = lse(2z) − 2 lse;
        mean logit = Σ z / V;  is_top1: y is the first argmax
    the last three without a gradient, as TRL marks them."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = hidden @ weight.T  # (N, V)
        if bias is not None:
            z = z + bias
        # _torch_transform's order; TRL caps at `softcapping or 1.0` whenever it is not None
        z = z * logit_scale
        if final_logit_softcapping is not None:
            softcap = final_logit_softcapping or 1.0
            z = softcap * torch.tanh(z / softcap)
        z = z * (1 / temperature)
        lse = torch.logsumexp(z, -1)  # (N,)
        logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        entropy = (lse - (torch.softmax(z, -1) * z).sum(-1)) if "entropy" in outputs else None
        with torch.no_grad():
            log_sum_sq_probs = (torch.logsumexp(2 * z, -1) - 2 * lse
                                if "log_sum_sq_probs" in outputs else None)
            mean_logits = z.sum(-1) / z.shape[-1] if "mean_logits" in outputs else None
            # argmax returns the first maximum: TRL's strict test against the earlier tokens
            is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
    return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1


class _ChunkedLogProbFp64:
    """`trl_function.apply` (TRL's fused head), but `fused_head_torch` in fp64 when hidden and
    the head are fp64. TRL folds its logit tiles and forms p and every gradient in fp32 whatever
    the inputs' dtype, so a step on an fp64 model through it would share the fp32 head's
    roundings with the fp32 step it is the truth for."""

    def __init__(self, trl_function):
        self.trl_function = trl_function

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, *options):
        if all(t.dtype == torch.float64 for t in (hidden, weight, bias) if t is not None):
            return fused_head_torch(hidden, weight, bias, targets, temperature, *options)
        return self.trl_function.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       *options)


@contextlib.contextmanager
def _trl_fused_head_fp64():
    """TRL's fused head (`add_fused_lm_head`'s `_ChunkedLogProbFunction`) as
    `_ChunkedLogProbFp64` inside the block, TRL's own again after."""
    utils = sys.modules.get("trl.trainer.utils")
    if utils is None:  # not imported: no model has TRL's fused head to call
        yield
        return
    trl_function = utils._ChunkedLogProbFunction
    utils._ChunkedLogProbFunction = _ChunkedLogProbFp64(trl_function)
    try:
        yield
    finally:
        utils._ChunkedLogProbFunction = trl_function


@contextlib.contextmanager
def in_fp64(*models):
    """The fp32 `models` (None skipped) in fp64 inside the block and back in fp32 after: exact
    both ways, every fp32 value being an fp64 value. TRL's fused head computes in fp64 for them
    inside (`_ChunkedLogProbFp64`), so that a stock step inside is fp64 through the head too."""
    models = [m for m in models if m is not None]
    for m in models:
        odd = {t.dtype for t in (*m.parameters(), *m.buffers())
               if t.is_floating_point() and t.dtype != torch.float32}
        assert not odd, f"in_fp64 takes fp32 models, found {odd}"
        m.double()
    try:
        with _trl_fused_head_fp64():
            yield
    finally:
        for m in models:
            m.float()


def sum_bound(n: int, abs_sum: float, *, c: float = 4.0) -> float:
    """c * sqrt(n) * eps32 * sum|terms|: the rounding of an fp32 sum of n terms in any order, as
    random-walk roundings (the worst case is n * eps32 * sum|terms|; c = 4 is ~4 sigma)."""
    return c * math.sqrt(max(n, 1)) * EPS32 * abs_sum


def assert_loss_vs_fp64(ours, stock, ref, *, n_terms: int, term: float = 1.0,
                        k: float = K_REORDERED, what: str = "loss") -> None:
    """A loss that averages n_terms per-token terms of size <= max(term, |ref|), ours and stock
    in fp32 against fp64: within k of stock's error, plus the rounding floor of that mean
    (sum_bound over the terms) for when stock's own rounding happens to cancel."""
    scale = max(term, abs(float(ref)))
    assert_3way(torch.as_tensor(ours), torch.as_tensor(stock), torch.as_tensor(ref), k=k,
                atol=sum_bound(n_terms, scale), what=what)


def assert_grads_vs_fp64(ours: dict, stock: dict, ref: dict, *, k: float = K_REORDERED,
                         what: str = "grad") -> None:
    """Per parameter: ||ours - fp64|| <= k * ||stock - fp64|| + 4 ulp of ||fp64|| (Frobenius
    norms; the last for a tensor that stock happens to get nearly exact). The norm of n
    rounding errors is a stable statistic (relative spread ~ 1/sqrt(2n)) where their max is
    not; a wrong element or row still moves it by far more than the rounding's norm. Same
    parameter names in all."""
    assert ours.keys() == stock.keys() == ref.keys() and len(ref) > 0, (
        sorted(ours.keys() ^ ref.keys())[:4], sorted(stock.keys() ^ ref.keys())[:4])
    for n, r in ref.items():
        r = r.double()
        e_o = (ours[n].double() - r).norm().item()
        e_s = (stock[n].double() - r).norm().item()
        bound = k * e_s + 4 * EPS32 * r.norm().item()
        _log(f"{what} {n}", e_o, bound)
        if not e_o <= bound:
            diff = (ours[n].double() - r).abs()
            i = int(diff.reshape(-1).argmax())
            raise AssertionError(
                f"{what} {n}: ||ours - fp64|| = {e_o:.3e} > {k} * ||stock - fp64|| {e_s:.3e} + "
                f"4 ulp of ||fp64||; worst flat index {i}: ours "
                f"{ours[n].reshape(-1)[i].item():.8g}, fp64 {r.reshape(-1)[i].item():.8g}")


def gemm_bound(a, b) -> torch.Tensor:
    """Elementwise bound on the fp32 rounding of a @ b (K = a.shape[-1] terms per element)
    against fp64: sum_bound(K, (|a| @ |b|)_ij), plus one rounding of the result."""
    mag = a.detach().double().abs() @ b.detach().double().abs()
    return sum_bound(a.shape[-1], 1.0) * mag + EPS32 * mag


# ---------------------------------------------------------------- the LM head's fp32 gradients


def assert_within(ours, ref, bound, *, what: str) -> None:
    """|ours - ref| <= bound elementwise (bound a tensor of ref's shape, or a number); the
    element that uses most of its bound shown."""
    diff = (ours.double() - ref.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).to(diff.device).expand_as(diff)
    ratio = diff / bound.clamp(min=1e-300)
    i = int(ratio.reshape(-1).argmax()) if ratio.numel() else 0
    worst = ratio.reshape(-1)[i].item() if ratio.numel() else 0.0
    if ratio.numel():
        _log(what, diff.reshape(-1)[i].item(), bound.reshape(-1)[i].item())
    if not worst <= 1.0:
        raise AssertionError(
            f"{what}: |ours - ref| = {diff.reshape(-1)[i].item():.3e} > bound "
            f"{bound.reshape(-1)[i].item():.3e} at flat index {i} ({worst:.2f}x); ours "
            f"{ours.reshape(-1)[i].item():.8g}, ref {ref.reshape(-1)[i].item():.8g}")


def _head_fp64(h, w, b, tau):
    h, w = h.detach().double(), w.detach().double()
    z = (h @ w.T + (0.0 if b is None else b.detach().double())) / tau  # (N, V) fp64
    dz = sum_bound(h.shape[1], 1.0) * (h.abs() @ w.abs().T).amax(-1, keepdim=True) / tau
    return h, w, z, dz


def head_value_bounds(h, w, b, *, tau: float) -> dict:
    """Per-row bounds on fp32 log p[y] and entropy H of z = (h w^T + b) / tau against fp64, on
    any machine: every logit carries dz = sum_bound(H, max_v sum_i |h_i w_vi|) / tau (one
    more ulp for the bias and tau is inside sum_bound's c); log p = z_y - lse moves by <= 2 dz
    plus the V-term sum inside lse, sum_bound(V, 1) relative (terms e^(z - m) <= 1); H moves by
    2 dz (H + 1) plus the V-term sums of p z and p, sum_bound(V, |z_bar| + max|z|)."""
    h, w, z, dz = _head_fp64(h, w, b, tau)
    V = w.shape[0]
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    z_bar = (p * z).sum(-1)
    dz = dz.squeeze(-1)
    lse_sum = sum_bound(V, 1.0)
    return {"logp": 2 * dz + lse_sum + EPS32 * (logp.abs().amax(-1)),
            "entropy": 2 * dz * (ent + 1) + lse_sum * (1 + ent)
            + sum_bound(V, 1.0) * (z_bar.abs() + z.abs().amax(-1)) + EPS32 * ent}


def ce_bound(h, w, b, y, *, tau: float = 1.0, reduction: str = "mean", ignore_index=-100):
    """A bound on fp32 cross-entropy against fp64: per row head_value_bounds' log p bound
    (reduction "none"); their sum plus sum_bound over the N-term sum ("sum"); that / n_valid
    ("mean")."""
    valid = y != ignore_index
    vb = head_value_bounds(h, w, b, tau=tau)
    row = vb["logp"] * valid
    if reduction == "none":
        return row
    _, _, z, _ = _head_fp64(h, w, b, tau)
    nll = -torch.log_softmax(z, -1).gather(-1, y.clamp(min=0)[:, None]).squeeze(-1) * valid
    total = row.sum() + sum_bound(int(valid.sum()), nll.sum().item())
    return total / max(int(valid.sum()), 1) if reduction == "mean" else total


def head_grad_bounds(h, w, b, y, *, tau: float, a, e=None, ignore_index: int = -100,
                     operand_rel: float = 0.0) -> dict:
    """Elementwise bounds on fp32 gradients of L = sum_n a_n logp_n[y_n] + e_n H_n through
    z = (h w^T + b) / tau (cross-entropy: a = -1 or -1/N, e = 0), against fp64, on any machine.

    G = dL/dz (N, V) = a (onehot - p) - e p (log p + H). The fp32 logits carry per row
    dz_n = sum_bound(H, max_v sum_i |h_ni w_vi|) / tau; to first order that moves p_v by
    <= 2 dz p_v and log p_v, H by <= 2 dz, 2 dz (H + 1), so
    |dG_nv| <= 2 dz_n p_nv (|a_n| + |e_n| (|log p_nv + H_n| + H_n + 2)).
    The reductions dh = G w / tau (over V), dW = G^T h / tau, db = sum_n G / tau (over N) then
    round as sum_bound over terms of size |G'| |w| (|h|), with |G'| = |a| (onehot + p) +
    |e| p (|z| + |z_bar| + |log p + H|): the entropy term as a kernel may form it,
    sum p z w - z_bar sum p w, not only as sum p (z - z_bar) w. Plus one rounding of the result.
    `operand_rel`: the relative rounding of G (and of the entropy basis) when a kernel feeds
    them to the GEMMs in bf16: 2^-8 is the worst case of one truncation (kernels/split_float
    keeps the high bf16 half, one-signed: errors add up to the worst case, not as a random
    walk) or of two roundings to nearest (2^-9 each); adds operand_rel |G'| |w| (|h|).
    """
    h, w, z, dz = _head_fp64(h, w, b, tau)
    N, V = z.shape
    valid = y != ignore_index
    a = torch.as_tensor(a, dtype=torch.float64).expand(N) * valid
    e = (torch.zeros(N, dtype=torch.float64) if e is None
         else torch.as_tensor(e, dtype=torch.float64).expand(N) * valid)
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * logp).sum(-1, keepdim=True)  # (N, 1)
    z_bar = (p * z).sum(-1, keepdim=True)
    onehot = torch.zeros_like(p)
    onehot[valid, y[valid]] = 1.0
    a, e = a[:, None].abs(), e[:, None].abs()
    dG = 2 * dz * p * (a + e * ((logp + ent).abs() + ent + 2))
    G_mag = a * (onehot + p) + e * p * (z.abs() + z_bar.abs() + (logp + ent).abs())
    rv, rn = sum_bound(V, 1.0) + operand_rel, sum_bound(N, 1.0) + operand_rel
    return {
        "h": (rv * (G_mag @ w.abs()) + dG @ w.abs()) / tau,
        "w": (rn * (G_mag.T @ h.abs()) + dG.T @ h.abs()) / tau,
        "b": (rn * G_mag.sum(0) + dG.sum(0)) / tau,
    }


def divergence_grad_bounds(h, w, b, x, u, c, *, tau: float, up, G) -> dict:
    """Bounds on fp32 gradients of sum_n up_n D_n(p, q) (student p = softmax(z), teacher q)
    through z = (h w^T + b) / tau, against fp64, from G = dL/dz (fp64, autograd). A kernel
    forms G from p, q, their logs and z_bar = sum p z, each term of size at most
    |up| (p + q) (|z| + |z_bar| + |log p| + |log q| + 1) =: |G'|; the fp32 logits move
    those by 2 dz |G'| (dz as in head_value_bounds); the reductions then round as sum_bound
    over |G'| |w| (|h|), plus the result's own rounding (assert_head_grad adds it)."""
    h64, w64, z, dz = _head_fp64(h, w, b, tau)
    N, V = z.shape
    lp = torch.log_softmax(z, -1)
    lq = torch.log_softmax((x.double() @ u.double().T + (0.0 if c is None else c.double()))
                           / tau, -1)
    p, q = lp.exp(), lq.exp()
    z_bar = (p * z).sum(-1, keepdim=True)
    upa = torch.as_tensor(up, dtype=torch.float64).abs()[:, None]
    G_mag = G.detach().double().abs() + upa * (p + q) * (
        z.abs() + z_bar.abs() + lp.abs().clamp(max=1e3) + lq.abs().clamp(max=1e3) + 1)
    rv = sum_bound(V, 1.0) + 2 * dz
    rn = sum_bound(N, 1.0)
    return {"h": (rv * G_mag) @ w64.abs() / tau,
            "w": (rn * G_mag + 2 * dz * G_mag).T @ h64.abs() / tau,
            "b": (rn * G_mag + 2 * dz * G_mag).sum(0) / tau}


def bf16_grad_bounds(h, w, G, *, tau: float) -> dict:
    """Bounds on the gradients dh = G w / tau, dW = G^T h / tau, db = sum_n G / tau of a head
    whose kernel feeds G (N, V) = dL/dz (fp64 here, from autograd) to the GEMMs in bf16: 2^-8
    (one truncation, or two roundings to nearest at 2^-9; see head_grad_bounds) plus
    sum_bound's fp32 accumulation, of |G| |w| (|h|); a worst case, not a random walk. The fp32 logits' own error moves G by ~1e-6 relative, 4 orders below and
    left out: for fp32 gradients use head_grad_bounds."""
    h, w, G = h.detach().double(), w.detach().double(), G.detach().double().abs()
    N, V = G.shape
    rv, rn = sum_bound(V, 1.0) + 2.0**-8, sum_bound(N, 1.0) + 2.0**-8
    return {"h": rv * (G @ w.abs()) / tau, "w": rn * (G.T @ h.abs()) / tau,
            "b": rn * G.sum(0) / tau}


def assert_head_grad(ours, ref, bound, *, what: str) -> None:
    """A head gradient against fp64 within `head_grad_bounds`' bound plus one rounding of the
    result to its dtype (fp32: EPS32 |ref|; bf16: 2^-8 |ref|, one truncation or two roundings
    to nearest)."""
    rel = EPS32 if ours.dtype == torch.float32 else torch.finfo(ours.dtype).eps
    assert_within(ours, ref, bound + rel * ref.detach().double().abs(), what=what)
