"""Tolerance helpers: ours and plain torch in the test dtype, both against fp64 (three-way); two
fp32 runs against the fp64 run of one of them; rounding bounds from sum lengths and magnitudes.

`GRPO_LCE_TOLERANCE_LOG=path` appends one line per comparison made here (what, error, bound),
for reading how much of each bound a machine uses.
"""

import contextlib
import math
import os

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
            f.write(f"{err / bound if bound > 0 else float('inf'):.3e}\t{err:.3e}\t{bound:.3e}"
                    f"\t{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}\t{what}\n")


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
# |ours - fp64| <= |stock - fp64| + |ours - stock|, the last at most two such errors: k = 3.
# This scales with whatever the depth of the backward and the lengths of its sums make stock's
# own error, on every machine, where a fixed rtol x max|ref| holds on one BLAS build only.
K_REORDERED = 3.0


@contextlib.contextmanager
def in_fp64(*models):
    """The fp32 `models` (None skipped) in fp64 inside the block and back in fp32 after: exact
    both ways, every fp32 value being an fp64 value."""
    models = [m for m in models if m is not None]
    for m in models:
        odd = {t.dtype for t in (*m.parameters(), *m.buffers())
               if t.is_floating_point() and t.dtype != torch.float32}
        assert not odd, f"in_fp64 takes fp32 models, found {odd}"
        m.double()
    try:
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
    """Per parameter: max |ours - fp64| <= k * max |stock - fp64| + 4 ulp of max |fp64| (the
    last for a tensor that stock happens to get nearly exact). Same parameter names in all."""
    assert ours.keys() == stock.keys() == ref.keys() and len(ref) > 0, (
        sorted(ours.keys() ^ ref.keys())[:4], sorted(stock.keys() ^ ref.keys())[:4])
    for n, r in ref.items():
        floor = 4 * EPS32 * r.abs().max().item() if r.numel() else 0.0
        assert_3way(ours[n], stock[n], r, k=k, atol=floor, what=f"{what} {n}")
