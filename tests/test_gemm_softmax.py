"""The fused path (GEMM 1 with the softmax statistics in its epilogue, kernels/gemm_softmax.py)
against fp64 and against the unfused loop, interpreted on CPU (bf16 tiles upcast, see DOT_F32).

Run: python -m pytest tests/test_gemm_softmax.py -q
"""

import pytest
import torch
import triton
import triton.language as tl

from grpo_lce import linear_cross_entropy, linear_logprobs
from grpo_lce._dispatch import recording
from grpo_lce.kernels._tma_common import tile_coords
from grpo_lce.kernels.split_float import join as join_split
from grpo_lce.reference import cross_entropy_ref, logits_ref, logprobs_ref
from _head_inputs import head_inputs
from _tolerance import FUSED_GRAD_RTOL as GRAD_RTOL
from _tolerance import FUSED_VALUE_ATOL as VALUE_ATOL
from _tolerance import (assert_3way, assert_close_scaled, assert_within, ce_bound,
                        head_value_bounds, sum_bound)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("fused_triton_env")


def _flagged(rec):
    """The flagged-row count of every chunk of the fused calls with a gradient recorded in
    `rec` (one per chunk: proves which path ran)."""
    return [int(n_flag.item()) for n_flag in rec.of("flagged")]


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 x with the low 8 bits of each value cleared (what kernels/split_float keeps)."""
    return (x.view(torch.int32) & ~0xFF).view(torch.float32)


def _to(dev, *ts):
    return [None if t is None else t.to(dev) for t in ts]


# N not a multiple of the 128-row tile, V not a multiple of the 256-column tile, N = 1
@pytest.mark.parametrize("N, H, V, chunk", [(1, 16, 101, None), (150, 24, 700, 64),
                                            (37, 32, 257, None)])
@pytest.mark.parametrize("train_head", [False, True], ids=["frozenW", "trainW"])
def test_fused_matches_fp64_and_unfused(N, H, V, chunk, train_head, dispatch_override):
    h, w, b, y = head_inputs(N, H, V, torch.bfloat16, True, N // 6)
    h, w, b, y = _to(DEV, h, w, b, y)
    g = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(DEV)
    results = {}
    for fused in ("1", "0"):
        dispatch_override(fused=fused == "1")
        hh = h.clone().requires_grad_()
        ww = w.clone().requires_grad_(train_head)
        with recording() as rec:
            lp = linear_logprobs(hh, ww, y, bias=b, temperature=0.8, chunk_size=chunk)
            (lp * g).sum().backward()
        results[fused] = (lp, hh.grad, ww.grad)
        flagged = _flagged(rec)
        assert bool(flagged) == (fused == "1") and not any(flagged)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_(train_head)
    rl, _ = logprobs_ref(h64, w64, y, bias=b.double(), temperature=0.8)
    (rl * g.double()).sum().backward()
    vb = head_value_bounds(h.cpu(), w.cpu(), b.cpu(), tau=0.8)["logp"].to(rl.device)
    for fused, (lp, dh, dw) in results.items():
        assert_within(lp, rl, vb, what=f"logp fused={fused}")
        assert_close_scaled(dh, h64.grad, rtol=GRAD_RTOL, what=f"d hidden fused={fused}")
        if train_head:
            assert_close_scaled(dw, w64.grad, rtol=GRAD_RTOL, what=f"d weight fused={fused}")
    # two fp32 evaluations, each within vb of fp64
    assert_within(results["1"][0], results["0"][0], 2 * vb, what="logp fused vs unfused")


def test_cross_entropy_metrics_and_trainable_head():
    N, H, V = 90, 32, 520
    h, w, _, y = head_inputs(N, H, V, torch.bfloat16, False, 9)
    h, w, y = _to(DEV, h, w, y)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with recording() as rec:
        loss, m = linear_cross_entropy(hh, ww, y, return_metrics=True, chunk_size=32)
        loss.backward()
    # 81 valid rows of 90 in the device-counted layout: the last chunk holds 17 valid rows
    chunks, flagged = rec.of("gemm1"), _flagged(rec)  # one fused GEMM 1 launch per chunk
    assert chunks == [32, 32, 26] and flagged == [0, 0, 0]
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = cross_entropy_ref(h64, w64, y)
    ref.backward()
    assert_within(loss, ref, ce_bound(h.cpu(), w.cpu(), None, y.cpu()), what="CE")
    assert_close_scaled(hh.grad, h64.grad, rtol=GRAD_RTOL, what="CE d hidden")
    assert_close_scaled(ww.grad, w64.grad, rtol=GRAD_RTOL, what="CE d weight")
    z = h64.detach() @ w64.detach().t()
    valid = y != -100
    assert int(m["correct"]) == int((z.argmax(1) == y)[valid].sum())
    p = torch.softmax(z[valid], 1)
    ent = -(p * torch.log(p)).sum()
    ent_bound = head_value_bounds(h.cpu(), w.cpu(), None, tau=1.0)["entropy"][valid.cpu()]
    assert_within(m["entropy_sum"].cpu(), ent.cpu(),
                  ent_bound.sum() + sum_bound(int(valid.sum()), float(ent)), what="entropy sum")


@pytest.mark.parametrize("train_head", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["frozenW", "trainW"])
def test_far_targets_take_the_exact_fallback(train_head):
    """Targets 100+ nats below the row max overflow no shift: those rows are flagged, G' drops
    them and the fixup kernel adds their exact gradient (module docstring of gemm_softmax)."""
    N, H, V = 40, 32, 600
    h, w, _, _ = head_inputs(N, H, V, torch.bfloat16, False, 0)
    h = (h.float() * 30).to(torch.bfloat16)  # logits of std ~90
    z = h.double() @ w.double().t()
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(5))
    y[::2] = z[::2].argmin(1)  # half the rows: the least likely token
    h, w, y = _to(DEV, h, w, y)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(train_head)
    g = torch.randn(N, generator=torch.Generator().manual_seed(6)).to(DEV)
    with recording() as rec:
        lp = linear_logprobs(hh, ww, y, chunk_size=16)
        (lp * g).sum().backward()
    flagged = _flagged(rec)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_(train_head)
    rl, _ = logprobs_ref(h64, w64, y)
    (rl * g.double()).sum().backward()
    assert rl[::2].max() < -100 and sum(flagged) >= N // 2
    # fp32 logits of magnitude ~300: the bound scales with their sum_i |h_i w_vi|
    assert_within(lp, rl, head_value_bounds(h.cpu(), w.cpu(), None, tau=1.0)["logp"].to(rl.device),
                  what="logp")
    assert_close_scaled(hh.grad, h64.grad, rtol=GRAD_RTOL, what="d hidden")
    if train_head:
        assert_close_scaled(ww.grad, w64.grad, rtol=GRAD_RTOL, what="d weight")


def test_minus_inf_bias_tiles_are_exact():
    """A bias of -inf masking a whole 256-column tile and scattered columns: no nan, exact."""
    N, H, V = 20, 16, 700
    h, w, b, y = head_inputs(N, H, V, torch.bfloat16, True, 2)
    b[256:512] = float("-inf")
    b[::7] = float("-inf")
    y[(y >= 256) & (y < 512)] = 3
    y[y % 7 == 0] = 1
    h, w, b, y = _to(DEV, h, w, b, y)
    hh = h.clone().requires_grad_()
    with recording() as rec:
        lp, ent = linear_logprobs(hh, w, y, bias=b, return_entropy=True)
        lp.sum().backward()
    flagged = _flagged(rec)
    h64 = h.double().requires_grad_()
    rl, _ = logprobs_ref(h64, w.double(), y, bias=b.double())
    rl.sum().backward()
    lp_all = torch.log_softmax(logits_ref(h64.detach(), w.double(), b.double()), -1)
    re = -torch.where(lp_all > float("-inf"), lp_all.exp() * lp_all, 0.0).sum(-1)
    re = torch.where(y != -100, re, 0.0)  # (the reference's own 0 · -inf is nan)
    assert flagged == [0]
    assert_3way(lp, None, rl, k=0, atol=VALUE_ATOL, what="logp")
    assert_3way(ent, None, re, k=0, atol=VALUE_ATOL, what="entropy")
    assert_close_scaled(hh.grad, h64.grad, rtol=GRAD_RTOL, what="d hidden")


@pytest.mark.parametrize("grad", [False, True], ids=["stats", "withG"])
def test_argmax_ignores_minus_inf_tiles(grad):
    """Every logit far below 0 and a bias of -inf over the first 256-column tile: that tile's
    statistics are relative to 0, not to its max (-inf); the argmax must still come from the
    tile maxima. Targets are the argmax, so every row counts as correct."""
    N, H, V = 24, 16, 700
    h, w, b, _ = head_inputs(N, H, V, torch.bfloat16, True, 5)
    b = b - 60.0
    b[:256] = float("-inf")
    z = logits_ref(h.double(), w.double(), b.double())
    y = z.argmax(1)
    h, w, b, y = _to(DEV, h, w, b, y)
    hh = h.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        loss, m = linear_cross_entropy(hh, w, y, bias=b, return_metrics=True)
    if grad:
        loss.backward()
    assert int(m["correct"]) == N
    p = torch.softmax(z, 1)
    ent = -torch.where(p > 0, p * torch.log(p), 0.0).sum()
    assert abs(float(m["entropy_sum"]) - float(ent)) <= VALUE_ATOL * N


@pytest.mark.parametrize("N, n_valid", [(1, None), (37, 30), (37, None)])
def test_target_logits_match_fp64(N, n_valid):
    """The per-row target logit (kernels/target_logit) that gives z_y and the shift of G':
    rows of a wider tensor (row stride > H), H past one 256-wide step and not a multiple of it,
    a bias and a temperature, targets at both ends of [0, V); rows at or past a device count
    are 0. Tolerance: fp32 accumulation of H bf16 products, 1e-6 of Σ|x_i w_i|."""
    from grpo_lce.kernels.gemm_softmax import LOG2E
    from grpo_lce.kernels.target_logit import target_logits

    H, V, tau = 300, 500, 0.7
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(N, H + 20, generator=g).to(torch.bfloat16)
    x = wide[:, 3:3 + H]
    w = (torch.randn(V, H, generator=g) * H**-0.5).to(torch.bfloat16)
    b = torch.randn(V, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    y[0], y[-1] = V - 1, 0
    scale2 = LOG2E / tau
    x, w, b, y = _to(DEV, x, w, b, y)
    count = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32, device=DEV)
    got = target_logits(x, w, y, b * scale2, scale2, count).cpu().double()
    prod = x.cpu().double() * w.cpu().double()[y.cpu()]
    ref = prod.sum(1) * scale2 + b.cpu().double()[y.cpu()] * scale2
    bound = 1e-6 * prod.abs().sum(1) * scale2 + 1e-6
    k = N if n_valid is None else n_valid
    assert ((got[:k] - ref[:k]).abs() <= bound[:k]).all(), (got[:k] - ref[:k]).abs().max()
    assert (got[k:] == 0).all()


@pytest.mark.parametrize("k, with_alpha", [(1, True), (37, True), (37, False)])
def test_target_terms_match_fp64(k, with_alpha):
    """kernels/target_terms around the cuBLAS GEMMs: basis = f (G'W) − α W[y] (fp32 in place,
    or split in 3 bytes), xf = bf16(f x), dW[y] −= α x with repeated targets (H = 300: a partial
    column step)."""
    from grpo_lce.kernels.target_terms import finish_basis_and_scale_rows, scatter_target

    V, H = 50, 300
    gen = torch.Generator().manual_seed(k)
    gw = torch.randn(k, H, generator=gen)  # stands for G' W
    x = torch.randn(k, H, generator=gen).to(torch.bfloat16)
    w = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    f, a = torch.rand(k, generator=gen), torch.rand(k, generator=gen)
    y = torch.randint(0, 5, (k,), generator=gen)  # few targets: rows share them
    dw0 = torch.randn(V, H, generator=gen)
    gw, x, w, f, a, y, dw0 = _to(DEV, gw, x, w, f, a, y, dw0)
    alpha = a if with_alpha else None
    a64 = a.double() if with_alpha else torch.ones(k, dtype=torch.float64, device=DEV)

    basis = gw.clone()
    xf = finish_basis_and_scale_rows(x, f, y, w, alpha=alpha, gw=basis, basis=basis,
                                     want_xf=True)
    ref = f.double()[:, None] * gw.double() - a64[:, None] * w.double()[y]
    # two fp32 roundings (product, difference) of O(1) terms
    assert (basis.double() - ref).abs().max() <= 4 * 2.0**-24 * (ref.abs().max() + 1)
    # one product rounded to fp32, then to bf16 (nearest even): within 2^-8 relative
    xf_ref = f.double()[:, None] * x.double()
    assert ((xf.double() - xf_ref).abs() <= 2.0**-8 * xf_ref.abs() + 1e-30).all()
    assert finish_basis_and_scale_rows(x, f, y, w, alpha=alpha) is None
    # the fused loop's basis split in 3 bytes, its bf16 half over the rows of x (no xf then):
    # exactly the fp32 result above with its low 8 bits dropped
    x_over, lo = x.clone(), torch.empty(k, H, dtype=torch.uint8, device=DEV)
    assert finish_basis_and_scale_rows(x_over, f, y, w, alpha=alpha, gw=gw, basis=x_over,
                                       basis_lo=lo) is None
    torch.testing.assert_close(join_split(x_over, lo), _truncated(basis), rtol=0, atol=0)

    dw = dw0.clone()
    scatter_target(dw, x, alpha, y)
    dw_ref = dw0.double().index_add(0, y, -a64[:, None] * x.double())
    # fp32 sums of up to k terms in some order
    assert (dw.double() - dw_ref).abs().max() <= k * 2.0**-23 * (dw_ref.abs().max() + 1)


@pytest.mark.parametrize("K, expected", [(896, 32), (2048, 16), (4096, 8), (64, 32)])
def test_group_m_keeps_the_x_slab_within_l2(K, expected):
    """The G' launch's tile groups: the most row tiles (GROUP_M..GROUP_M_MAX, powers of two)
    whose bf16 X slab fits GROUP_X_BYTES; a config without GROUP_M_MAX keeps its GROUP_M."""
    from grpo_lce.kernels import _tuning
    from grpo_lce.kernels.gemm_softmax import group_m

    cfg = _tuning.GEMM_GRAD
    g = group_m(cfg, K, 2)
    assert g == expected
    assert cfg["GROUP_M"] <= g <= cfg["GROUP_M_MAX"]
    assert g == cfg["GROUP_M"] or g * cfg["BM"] * K * 2 <= _tuning.GROUP_X_BYTES
    assert 2 * g > cfg["GROUP_M_MAX"] or 2 * g * cfg["BM"] * K * 2 > _tuning.GROUP_X_BYTES
    assert group_m(dict(cfg, GROUP_M_MAX=8), K, 2) == 8
    assert group_m({k: v for k, v in cfg.items() if k != "GROUP_M_MAX"}, K, 2) == 8


@triton.jit
def _walk_tiles(out_ptr, num_m, num_n, GROUP_M: tl.constexpr):
    for t in range(num_m * num_n):
        pid_m, pid_n = tile_coords(t, num_m, num_n, GROUP_M)
        tl.store(out_ptr + 2 * t, pid_m)
        tl.store(out_ptr + 2 * t + 1, pid_n)


@pytest.mark.parametrize("num_m, num_n, group", [(33, 5, 32), (32, 3, 32), (7, 4, 8),
                                                 (40, 6, 16), (1, 9, 32)])
def test_grouped_tile_order_visits_every_tile_once(num_m, num_n, group):
    """tile_coords (the persistent GEMMs' tile order) is a bijection from tile ids onto the
    (row block, column block) grid for any group size, a partial last group included."""
    out = torch.full((num_m * num_n, 2), -1, dtype=torch.int32, device=DEV)
    _walk_tiles[(1,)](out, num_m, num_n, GROUP_M=group)
    seen = {tuple(r) for r in out.tolist()}
    assert len(seen) == num_m * num_n
    assert seen == {(m, n) for m in range(num_m) for n in range(num_n)}
