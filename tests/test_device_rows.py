"""The device-counted row layout (grpo_lce/_rows.py): ignored rows moved after the valid ones, their
number read by the kernels on the device (kernels/gemm_rows.py), no host sync. On CPU the Triton
kernels run in the interpreter; the GPU-only checks (no sync at all, the deferred error) are in
tests/test_gpu_core.py, marked `gpu`.

Run: python -m pytest tests/test_device_rows.py -q
"""

import pytest
import torch
import triton
import triton.language as tl

from grpo_lce import linear_cross_entropy, linear_logprobs
from grpo_lce._dispatch import recording
from grpo_lce.kernels import gemm_rows as gr
from grpo_lce.kernels import gemm_softmax as gs
from grpo_lce.kernels.split_float import join as join_split
from grpo_lce.kernels.split_float import load_split, store_split
from grpo_lce.kernels.split_float import split as split_f32
from grpo_lce.reference import cross_entropy_ref, logprobs_ref
from _head_inputs import head_inputs
from _tolerance import FUSED_GRAD_RTOL as GRAD_RTOL
from _tolerance import (EPS32, assert_close_scaled, assert_within, ce_bound,
                        gemm_bound, head_value_bounds, sum_bound)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("fused_triton_env")


def _on_device(rec):
    """Whether each call recorded in `rec` counted its rows on the device."""
    return [path.rows_on_device for path in rec.paths]


def _g_operand(M, V, gen):
    """A G' buffer as the fused loop allocates it: rows padded to 16 bytes (TMA)."""
    g = torch.empty(M, gs.g_row_stride(V), dtype=torch.bfloat16, device=DEV)[:, :V]
    g.copy_(torch.rand(M, V, generator=gen))
    return g


@pytest.mark.parametrize("n_valid, row0", [pytest.param(1000, 0, marks=pytest.mark.slow), (45, 0),
                                           pytest.param(100, 70, marks=pytest.mark.slow), (3, 70),
                                           (0, 0)])
def test_row_bounded_gemms_match_fp64(n_valid, row0):
    """basis = factor ∘ (G' W) − α ∘ W[y] and dW += G'ᵀ X over the chunk's rows below the
    device count; the basis rows past it are 0, dW gets nothing from them."""
    gen = torch.Generator().manual_seed(0)
    M, V, H = 70, 300, 48  # ragged against every tile size below
    g = _g_operand(M, V, gen)
    w = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    factor, alpha = torch.rand(M, generator=gen), torch.rand(M, generator=gen)
    y = torch.randint(0, V, (M,), generator=gen)
    m = max(0, min(n_valid - row0, M))
    count = torch.tensor([n_valid], dtype=torch.int32)
    w, factor, alpha, y, count = (t.to(DEV) for t in (w, factor, alpha, y, count))
    ref = factor.double()[:, None] * (g.double() @ w.double()) \
        - alpha.double()[:, None] * w.double()[y]
    ref[m:] = 0
    # fp32 accumulation of exact bf16 products over V: gemm_bound of each term, elementwise
    tol = (factor.double().abs()[:, None] * gemm_bound(g, w)
           + alpha.double().abs()[:, None] * w.double()[y].abs() * 2 * EPS32)
    cfg = dict(BM=32, BN=32, BK=16, num_warps=4, num_stages=2)
    for split in (1, 3):
        out = torch.full((M, H), 7.0, device=DEV)
        gr.basis_gemm(g, w, factor, alpha, y, count, row0, out, cfg=cfg, split=split)
        assert (out[m:] == 0).all()
        assert_within(out, ref, tol, what=f"basis split={split}")
        # the fused loop's basis split in 3 bytes: the same fp32 result, low 8 bits dropped
        hi = torch.full((M, H), 7.0, device=DEV, dtype=torch.bfloat16)
        lo = torch.full((M, H), 7, device=DEV, dtype=torch.uint8)
        gr.basis_gemm(g, w, factor, alpha, y, count, row0, hi, out_lo=lo, cfg=cfg, split=split)
        expected = (out.view(torch.int32) & ~0xFF).view(torch.float32)
        torch.testing.assert_close(join_split(hi, lo), expected, rtol=0, atol=0)

    xf = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(DEV)
    g[m:] = 0  # as GEMM 1 writes it past the valid rows
    xf[m:] = 0
    ref_dw = 1.0 + g[:m].double().t() @ xf[:m].double()
    tol_dw = gemm_bound(g[:m].t(), xf[:m]) + EPS32 * ref_dw.abs()  # (+ 1: one more rounding)
    for group in (1, 3):
        cfg = dict(BV=32, BN=32, BK=16, GROUP_V=group, FLATTEN=True, num_warps=4, num_stages=2)
        dw = torch.ones(V, H, device=DEV)
        gr.grad_w_gemm(dw, g, xf, count, row0, first=False, cfg=cfg)
        assert_within(dw, ref_dw, tol_dw, what=f"dW += group={group}")
        gr.grad_w_gemm(dw, g, xf, count, row0, first=True, cfg=cfg)
        assert_within(dw, ref_dw - 1.0, tol_dw, what=f"dW = group={group}")


def test_split_count_fills_the_waves():
    cpu = torch.device("cpu")  # 4 "SMs" under the interpreter
    cfg = dict(BM=128, BN=256, BK=64)  # (the rule only reads the tile shape)
    assert gr.n_splits(128, 256, 100_000, cpu, cfg) == 4  # 1 tile: 4 splits fill 4 SMs
    assert gr.n_splits(256, 256, 100_000, cpu, cfg) == 2  # 2 tiles: 2 splits each
    assert gr.n_splits(1024, 2048, 100_000, cpu, cfg) == 1  # 64 tiles: already full waves
    assert gr.n_splits(128, 256, 64, cpu, cfg) == 1  # K too short to split


# chunk 32 over 150 rows with 100 ignored: two chunks are entirely past the valid rows
@pytest.mark.parametrize("N, n_ignored, chunk", [
    pytest.param(150, 100, 32, marks=pytest.mark.slow), (37, 5, None), (1, 0, None),
    (40, 40, 16)])
def test_logprobs_with_ignored_rows_match_fp64(N, n_ignored, chunk):
    H, V = 32, 300
    h, w, b, y = head_inputs(N, H, V, torch.bfloat16, True, n_ignored, seed=1)
    ignored = y == -100
    h[ignored.nonzero()[:1, 0]] = float("nan")  # an ignored row's state must not leak
    gen = torch.Generator().manual_seed(2)
    g, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    h, w, b, y, g, g_ent = (t.to(DEV) for t in (h, w, b, y, g, g_ent))
    hh = h.clone().requires_grad_()
    with recording() as rec:
        lp, ent = linear_logprobs(hh, w, y, bias=b, temperature=0.7, return_entropy=True,
                                  chunk_size=chunk)
        # upstream gradients on both outputs: the entropy's is recomputed over the padded layout
        (lp * g + ent * g_ent).sum().backward()
    seen = _on_device(rec)
    assert seen == [True]
    h_ref = torch.where(ignored.to(DEV)[:, None], 0.0, h.double()).requires_grad_()
    rl, re = logprobs_ref(h_ref, w.double(), y, bias=b.double(), temperature=0.7)
    (rl * g.double() + re * g_ent.double()).sum().backward()
    vb = head_value_bounds(h_ref.cpu(), w.cpu(), b.cpu(), tau=0.7)
    assert_within(lp, rl, vb["logp"].to(rl.device), what="logp")
    assert_within(ent, re, vb["entropy"].to(re.device), what="entropy")
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert torch.isfinite(hh.grad).all() and (hh.grad[ignored] == 0).all()
    if n_ignored < N:
        assert_close_scaled(hh.grad, h_ref.grad, rtol=GRAD_RTOL, what="d hidden")


@pytest.mark.parametrize("n_ignored", [0, 9])
def test_frozen_basis_goes_over_the_gathered_rows(n_ignored):
    """Frozen head, fused path: the basis's bf16 half is written over the call's own gathered
    copy of the rows (kernels/split_float), never over the caller's hidden states, which stay
    bit-identical; log-probs and CE, with and without ignored rows, several chunks."""
    N, H, V = 40, 32, 300
    h, w, _, y = head_inputs(N, H, V, torch.bfloat16, False, n_ignored, seed=6)
    g = torch.randn(N, generator=torch.Generator().manual_seed(7))
    h, w, y, g = (t.to(DEV) for t in (h, w, y, g))
    hh = h.clone().requires_grad_()
    with recording() as rec:
        (linear_logprobs(hh, w, y, chunk_size=16) * g).sum().backward()
        dh_lp = hh.grad.clone()
        hh.grad = None
        linear_cross_entropy(hh, w, y, chunk_size=16).backward()
    # per pass that builds a basis: (rows are the call's copy, basis dtype, its low half's
    # dtype, whether the basis is stored over those rows)
    seen = rec.of("basis")
    assert seen == [(True, torch.bfloat16, torch.uint8, True)] * 2
    assert torch.equal(hh.detach(), h)
    h64 = h.double().requires_grad_()
    rl, _ = logprobs_ref(h64, w.double(), y)
    (rl * g.double()).sum().backward()
    assert_close_scaled(dh_lp, h64.grad, rtol=GRAD_RTOL, what="logp d hidden")
    h64.grad = None
    cross_entropy_ref(h64, w.double(), y).backward()
    assert_close_scaled(hh.grad, h64.grad, rtol=GRAD_RTOL, what="CE d hidden")


@pytest.mark.parametrize("reduction, num_items", [
    pytest.param("mean", None, marks=pytest.mark.slow), ("sum", None), ("sum", 7)])
def test_cross_entropy_device_rows_match_host_rows(reduction, num_items, dispatch_override):
    """Frozen head: device-counted rows; sync checks on (GRPO_LCE_SYNC_CHECKS=1): host-counted.
    Same loss, gradient and metrics (argmax of the padding rows is −1, so never `correct`)."""
    N, H, V = 150, 32, 520
    h, w, _, y = head_inputs(N, H, V, torch.bfloat16, False, 60, seed=4)
    y[y != -100] = 0  # many targets equal to the padding rows' placeholder label
    h, w, y = (t.to(DEV) for t in (h, w, y))
    results = {}
    for sync in ("0", "1"):
        dispatch_override(sync_checks=sync == "1")
        hh = h.clone().requires_grad_()
        with recording() as rec:
            loss, m = linear_cross_entropy(hh, w, y, reduction=reduction, num_items=num_items,
                                           return_metrics=True, chunk_size=32)
            loss.backward()
        seen = _on_device(rec)
        assert seen == [sync == "0"]
        results[sync] = (loss, hh.grad, m)
    h64 = h.double().requires_grad_()
    ref = cross_entropy_ref(h64, w.double(), y, reduction=reduction, num_items=num_items)
    ref.backward()
    (l0, d0, m0), (l1, d1, m1) = results["0"], results["1"]
    # the loss sums per-token values rounded in fp32 (948 for "sum"), in another order on each
    # path: ce_bound (per-token bounds plus the sum's rounding), / num_items where given
    tol = ce_bound(h.cpu(), w.cpu(), None, y.cpu(), reduction=reduction) / (num_items or 1)
    assert_within(l0, ref, tol, what="CE device rows")
    assert_close_scaled(d0, h64.grad, rtol=GRAD_RTOL, what="CE d hidden")
    assert_within(l0, l1, 2 * tol, what="CE device vs host rows")  # each within tol of fp64
    # the host-counted basis is cuBLAS, the device-counted one the Triton split-K kernel: fp32
    # sums in another order, then rounded to bf16: at most one bf16 step apart, and a step of
    # x is at most 2^-7 |x|
    assert_close_scaled(d0, d1, rtol=2.0**-7, what="dh device vs host rows")
    for k in ("correct", "num_tokens"):
        assert int(m0[k]) == int(m1[k]), k
    assert int(m0["num_tokens"]) == 90
    _assert_entropy_sums(m0, m1, h, w, y)


def _assert_entropy_sums(m0, m1, h, w, y):
    """The entropy sums of two fp32 paths over the valid rows, each within its per-row entropy
    bounds plus the sum's rounding of fp64: 2x that apart at most."""
    valid = (y != -100).cpu()
    ent = head_value_bounds(h.cpu(), w.cpu(), None, tau=1.0)["entropy"][valid]
    tol = ent.sum() + sum_bound(int(valid.sum()), float(m0["entropy_sum"]))
    assert_within(m0["entropy_sum"].cpu(), m1["entropy_sum"].cpu(), 2 * tol, what="entropy sum")


def _host_reads(rec):
    """In order, the fused GEMM 1 launches ("gemm1") and the host reads of the row count
    ("read") recorded in `rec`: the read must come after chunk 0's GEMM 1 is queued."""
    names = {"gemm1": "gemm1", "count read": "read"}
    return [names[kind] for kind, _ in rec.events if kind in names]


# 150 rows, 100 ignored, chunks of 32: the count is read after chunk 0, then chunk 1 (18 valid
# rows) runs and chunks 2-4 (rows 64..149, all ignored) are skipped; 40 of 40 ignored: chunk 0
# runs (the count is not known yet), then nothing
@pytest.mark.parametrize("N, n_ignored, chunk, gemm1", [
    (150, 100, 32, 2), (37, 5, None, 1), (40, 40, 16, 1), (1, 0, None, 1)])
def test_trainable_head_device_rows_match_fp64_and_host_rows(N, n_ignored, chunk, gemm1,
                                                             dispatch_override):
    """Trainable W in the device-counted layout, its count read on the host after chunk 0's
    GEMM 1 (cuBLAS GEMMs 2 and 3 sized by it, the chunks past it skipped): CE loss, metrics,
    dh and dW against fp64 and against the host-counted layout (sync checks on)."""
    H, V = 32, 300
    h, w, _, y = head_inputs(N, H, V, torch.bfloat16, False, n_ignored, seed=5)
    ignored = y == -100
    h[ignored.nonzero()[:1, 0]] = float("nan")  # an ignored row's state must not leak
    h, w, y = (t.to(DEV) for t in (h, w, y))
    results = {}
    for sync in ("0", "1"):
        dispatch_override(sync_checks=sync == "1")
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with recording() as rec:
            loss, m = linear_cross_entropy(hh, ww, y, return_metrics=True, chunk_size=chunk)
            loss.backward()
        seen, events = _on_device(rec), _host_reads(rec)
        assert seen == [sync == "0"]
        if sync == "0":
            assert events == ["gemm1", "read"] + ["gemm1"] * (gemm1 - 1), events
        else:
            assert "read" not in events
        results[sync] = (loss, hh.grad, ww.grad, m)
    h0 = torch.where(ignored.to(DEV)[:, None], 0.0, h.double())
    h64, w64 = h0.requires_grad_(), w.double().requires_grad_()
    ref = cross_entropy_ref(h64, w64, y)
    ref.backward()
    (l0, dh0, dw0, m0), (l1, dh1, dw1, m1) = results["0"], results["1"]
    tol = ce_bound(h0.detach().cpu(), w.cpu(), None, y.cpu())
    assert_within(l0, ref, tol, what="CE device rows, trainable W")
    assert_within(l0, l1, 2 * tol, what="CE device vs host rows")  # each within tol of fp64
    assert torch.isfinite(dh0).all() and (dh0[ignored] == 0).all()
    if n_ignored < N:
        assert_close_scaled(dh0, h64.grad, rtol=GRAD_RTOL, what="CE d hidden")
        assert_close_scaled(dw0, w64.grad, rtol=GRAD_RTOL, what="CE d weight")
    else:
        assert float(l0) == 0.0 and (dw0 == 0).all()
    # both layouts run the same cuBLAS GEMMs on the same valid rows, and both casts of dh to
    # bf16 (kernels/row_gather, torch) round to nearest even: bit-equal
    torch.testing.assert_close(dh0, dh1, rtol=0, atol=0)
    torch.testing.assert_close(dw0, dw1, rtol=0, atol=0)
    for k in ("correct", "num_tokens"):
        assert int(m0[k]) == int(m1[k]), k
    _assert_entropy_sums(m0, m1, h0.detach(), w, y)


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logp_grad", "with_entropy_grad"])
def test_trainable_head_logprobs_device_rows_match_fp64(entropy_grad):
    """linear_logprobs with trainable W in the device-counted layout: the forward reads no count
    on the host, the backward's recompute reads it once (fused path; with an entropy gradient
    the unfused loop, which stops at the count instead of computing the padding rows)."""
    N, H, V = 150, 32, 300
    h, w, b, y = head_inputs(N, H, V, torch.bfloat16, True, 100, seed=6)
    ignored = y == -100
    gen = torch.Generator().manual_seed(7)
    g, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    h, w, b, y, g, g_ent = (t.to(DEV) for t in (h, w, b, y, g, g_ent))
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with recording() as rec:
        lp, ent = linear_logprobs(hh, ww, y, bias=b, temperature=0.7, return_entropy=True,
                                  chunk_size=32)
    seen, events = _on_device(rec), _host_reads(rec)
    assert seen == [True] and "read" not in events
    loss = (lp * g).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
    loss.backward()  # (the forward's path still records: the backward runs on it)
    events = _host_reads(rec)
    assert events.count("read") == 1
    h_ref = torch.where(ignored.to(DEV)[:, None], 0.0, h.double()).requires_grad_()
    w_ref = w.double().requires_grad_()
    rl, re = logprobs_ref(h_ref, w_ref, y, bias=b.double(), temperature=0.7)
    ((rl * g.double()).sum() + ((re * g_ent.double()).sum() if entropy_grad else 0.0)).backward()
    vb = head_value_bounds(h_ref.detach().cpu(), w.cpu(), b.cpu(), tau=0.7)
    assert_within(lp, rl, vb["logp"].to(rl.device), what="logp")
    assert_within(ent, re, vb["entropy"].to(re.device), what="entropy")
    assert (hh.grad[ignored] == 0).all()
    assert_close_scaled(hh.grad, h_ref.grad, rtol=GRAD_RTOL, what="d hidden")
    assert_close_scaled(ww.grad, w_ref.grad, rtol=GRAD_RTOL, what="d weight")


def test_all_ignored_gives_zeros():
    h, w, _, y = head_inputs(20, 16, 200, torch.bfloat16, False, 20)
    h, w, y = (t.to(DEV) for t in (h, w, y))
    hh = h.clone().requires_grad_()
    loss, m = linear_cross_entropy(hh, w, y, return_metrics=True)
    loss.backward()
    assert float(loss) == 0.0 and int(m["num_tokens"]) == 0 and int(m["correct"]) == 0
    assert (hh.grad == 0).all()


@pytest.mark.skipif(DEV != "cpu", reason="on CUDA the error is deferred: test_gpu_core covers it")
def test_out_of_range_target_raises_on_cpu_at_once():
    h, w, _, y = head_inputs(10, 16, 200, torch.bfloat16, False, 2)
    y[y != -100] = torch.where(y[y != -100] > 100, 200, y[y != -100])
    with pytest.raises(ValueError, match="targets contains 200"):
        linear_logprobs(h, w, y)


@pytest.mark.parametrize("N, m", [(37, 20), (37, 37), (37, 0), (1, 1)])
def test_row_gather_and_scatter_match_torch(N, m):
    """kernels/row_gather (the CUDA layout; interpreted on CPU): gather = where(i < m,
    t[order], 0) from a strided t with NaN in a row it must not read; scatter = the weighted
    sum of two fp32 bases (or the first split in 3 bytes) put back at order, in bf16 (H = 300:
    a partial column step)."""
    from grpo_lce.kernels.row_gather import gather_rows, scatter_rows

    H = 300
    gen = torch.Generator().manual_seed(N + m)
    order = torch.randperm(N, generator=gen)
    t = torch.randn(H, N, generator=gen).to(torch.bfloat16).t()  # (N, H), row stride 1
    if m < N:
        t[order[m]] = float("nan")  # an ignored row
    count = torch.tensor([m], dtype=torch.int32)
    t, order, count = (x.to(DEV) for x in (t, order, count))
    x = gather_rows(t, order, count)
    ref = torch.where((torch.arange(N, device=DEV) < m)[:, None], t[order], 0.0)
    assert torch.equal(x, ref)

    u, v = torch.randn(N, H, generator=gen), torch.randn(N, H, generator=gen)
    g_row, g0 = torch.randn(N, generator=gen), torch.randn((), generator=gen)
    u[m:] = float("nan")  # past the count the bases are never read
    u, v, g_row, g0 = (x.to(DEV) for x in (u, v, g_row, g0))
    valid = (torch.arange(N, device=DEV) < m)[:, None]
    for w_u, w_v, has_v in [(g_row, g0, True), (g0, None, True), (None, None, False),
                            (g_row, None, False)]:
        d = scatter_rows(u, w_u, order, count, torch.bfloat16, s_u=-0.5,
                         v=v if has_v else None, w_v=w_v, s_v=2.0)

        def weight(w, s):
            w = torch.ones((), device=DEV) if w is None else w
            return s * (w[order][:, None] if w.dim() else w).double()
        exact = weight(w_u, -0.5) * u.double()
        if has_v:
            exact = exact + weight(w_v, 2.0) * v.double()
        exact = torch.where(valid, exact, 0.0)
        full = torch.empty_like(exact).index_copy_(0, order, exact)
        # one rounding to bf16 (nearest even) of an fp32 sum: within 2^-8 of the exact value
        assert ((d.double() - full).abs() <= 2.0**-8 * full.abs() + 1e-30).all(), (w_u, w_v)
    # u split in 3 bytes (kernels/split_float, the fused path's basis): the same as from the
    # fp32 u its two halves join to
    hi, lo = split_f32(u)
    kw = dict(s_u=-0.5, v=v, w_v=g0, s_v=2.0)
    d = scatter_rows(hi, g_row, order, count, torch.bfloat16, u_lo=lo, **kw)
    assert torch.equal(d, scatter_rows(join_split(hi, lo), g_row, order, count, torch.bfloat16,
                                       **kw))


@pytest.mark.parametrize("N, ignore_index, dtype", [
    (2500, -100, torch.int64),  # three blocks of the kernel, the last one partial
    (1, -100, torch.int64), (1, None, torch.int64), (1000, None, torch.int32),
    (300, 7, torch.int32),  # an ignore_index inside [0, V)
])
def test_partition_kernel_matches_a_plain_stable_partition(N, ignore_index, dtype):
    """kernels/partition (the CUDA layout; interpreted on CPU) against the partition written out
    in torch: valid rows first in order, targets 0 where ignored or out of range, the counts."""
    from grpo_lce.kernels.partition import partition_rows

    V = 50
    gen = torch.Generator().manual_seed(N)
    y = torch.randint(-3, V + 3, (N,), generator=gen)  # some out of range on both sides
    if ignore_index is not None:
        y[torch.rand(N, generator=gen) < 0.4] = ignore_index
    y = y.to(dtype)
    keep = torch.ones(N, dtype=torch.bool) if ignore_index is None else y != ignore_index
    bad = keep & ((y < 0) | (y >= V))
    order = torch.cat([keep.nonzero().squeeze(1), (~keep).nonzero().squeeze(1)])
    y_ref = torch.where(keep & ~bad, y, 0)[order].long()

    got = partition_rows(y.to(DEV), V, ignore_index)
    o, yr, b, valid, counts = (t.cpu() for t in got)
    assert torch.equal(o, order)
    assert torch.equal(yr, y_ref)
    assert torch.equal(b, bad[order])
    assert torch.equal(valid, keep[order])
    assert counts.tolist() == [int(keep.sum()), int(bad.sum())]


@triton.jit
def _split_roundtrip(x_ptr, hi_ptr, lo_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # (module level: the interpreter resolves a kernel's globals in its module)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    store_split(hi_ptr + offs, lo_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask)
    tl.store(y_ptr + offs, load_split(hi_ptr + offs, lo_ptr + offs, mask), mask=mask)


def test_split_float_kernels_match_the_torch_format():
    """kernels/split_float: store_split writes the bytes `split` gives, load_split reads back
    `join`'s values: fp32 truncated to 15 mantissa bits (< 2^-15 relative), 0, ±inf, NaN kept."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=gen) * torch.logspace(-30, 30, 1000)
    x[:5] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    x = x.to(DEV)
    hi = torch.empty(1000, device=DEV, dtype=torch.bfloat16)
    lo = torch.empty(1000, device=DEV, dtype=torch.uint8)
    y = torch.empty_like(x)
    _split_roundtrip[(triton.cdiv(1000, 256),)](x, hi, lo, y, 1000, BLOCK=256)
    hi_ref, lo_ref = split_f32(x)
    assert torch.equal(hi.view(torch.int16), hi_ref.view(torch.int16)) and torch.equal(lo, lo_ref)
    assert torch.equal(y.view(torch.int32), join_split(hi, lo).view(torch.int32))
    assert torch.equal(y.view(torch.int32), x.view(torch.int32) & ~0xFF)
    finite = torch.isfinite(x) & (x != 0)
    assert ((y - x)[finite].abs() < 2.0**-15 * x[finite].abs()).all()
    assert torch.isnan(y[4]) and torch.equal(y[:4], x[:4])
