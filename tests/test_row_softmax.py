"""The Triton row kernel (interpreted on CPU) against its torch twin and against fp64.

Run: python -m pytest tests/test_row_softmax.py -q
"""

import pytest
import torch
from _tolerance import EPS32, assert_within, sum_bound

from grpo_lce.kernels.row_softmax import row_softmax


def _run(backend, z, y, bias, inv_tau, op_dtype, alpha, beta):
    C, V = z.shape
    g = torch.empty(C, V, dtype=op_dtype)
    e = torch.empty(C, V, dtype=op_dtype)
    out = row_softmax(z, y, bias, inv_tau, backend=backend, g_out=g, e_out=e, alpha=alpha,
                      beta=beta, want_argmax=True)
    return (*out, g, e)


# V below, at and above the 4096-wide block and not a power of two; C = 1 and odd
@pytest.mark.parametrize("C, V", [(1, 7), (5, 4096), (3, 9001)])
@pytest.mark.parametrize("op_dtype", [torch.float32, torch.bfloat16], ids=["fp32op", "bf16op"])
def test_kernel_matches_torch_and_fp64(C, V, op_dtype):
    gen = torch.Generator().manual_seed(C * V)
    z = torch.randn(C, V, generator=gen) * 4
    y = torch.randint(0, V, (C,), generator=gen)
    bias = torch.randn(V, generator=gen)
    alpha, beta = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    inv_tau = 1 / 0.8
    tri = _run("triton", z, y, bias, inv_tau, op_dtype, alpha, beta)
    ref = _run("torch", z, y, bias, inv_tau, op_dtype, alpha, beta)
    z64 = (z.double() + bias.double()) * inv_tau
    lse64 = torch.logsumexp(z64, 1)
    p = torch.exp(z64 - lse64[:, None])
    z_bar = (p * z64).sum(1, keepdim=True)
    ent64 = lse64 - z_bar[:, 0]
    G64 = alpha.double()[:, None] * (p - torch.nn.functional.one_hot(y, V).double()) + \
        beta.double()[:, None] * p * (z64 - z_bar)
    # fp32 bounds against fp64 (tests/_tolerance.py's sum_bound): each z carries 2 ulp (the bias
    # add and 1/τ); lse the V-term sum of e^(z - m) <= 1 plus those; log p moves by
    # d = dz + dlse (+ the roundings of z - lse and exp), so p by p d; H = lse - z_bar adds
    # z_bar's V-term sum and max|z| d; G = α (p - onehot) + β p (z - z_bar) then moves by
    # p (|α| + |β| |z - z_bar|) d + |β| p (dz + dz_bar); plus one rounding of each result
    dz = 2 * EPS32 * z64.abs().amax(1, keepdim=True)
    dlse = sum_bound(V, 1.0) + dz + EPS32 * lse64.abs()[:, None]
    d = dz + dlse + 2 * EPS32 * (z64 - lse64[:, None]).abs()  # + z - lse and exp's roundings
    dz_bar = sum_bound(V, 1.0) * (p * z64.abs()).sum(1, keepdim=True) + z64.abs().amax(
        1, keepdim=True) * d
    bounds = {
        "lse": dlse[:, 0],
        "z_y": dz[:, 0],
        "entropy": (dlse + dz_bar)[:, 0] + EPS32 * ent64.abs(),
        "G": p * (alpha.double().abs()[:, None] + beta.double().abs()[:, None]
                  * (z64 - z_bar).abs()) * d
        + beta.double().abs()[:, None] * p * (dz + dz_bar) + EPS32 * G64.abs(),
    }
    names = ["lse", "z_y", "entropy", "argmax", "G", "E"]
    for name, a, b in zip(names, tri, ref):
        if name == "argmax":
            assert torch.equal(a, b)
            continue
        if a.dtype == torch.float32 and name in bounds:
            # two fp32 evaluations, each within its bound of fp64
            assert_within(a, b, 2 * bounds[name], what=f"{name} triton vs torch")
        else:  # bf16 operands: one bf16 step (2^-7 relative at most) either way
            tol = 8e-3 if a.dtype == torch.bfloat16 else 2e-5
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)
    # and against fp64
    assert_within(ref[0], lse64, bounds["lse"], what="torch lse")
    assert_within(tri[2], ent64, bounds["entropy"], what="entropy")
    if op_dtype == torch.float32:
        assert_within(tri[4], G64, bounds["G"], what="G")
    else:  # G rounded to bf16: 2^-8 relative, of the row's scale
        torch.testing.assert_close(tri[4].double(), G64, rtol=0,
                                   atol=2e-2 * G64.abs().max().item())


def test_minus_inf_bias_is_masked_not_nan():
    """A −inf logit (a banned token) has p = 0 and adds nothing, never a nan."""
    z = torch.randn(2, 300)
    bias = torch.zeros(300)
    bias[::3] = float("-inf")
    y = torch.tensor([1, 2])
    for backend in ("triton", "torch"):
        lse, zy, ent, _, g, e = _run(backend, z, y, bias, 1.0, torch.float32, None, None)
        assert torch.isfinite(lse).all() and torch.isfinite(ent).all()
        assert torch.isfinite(g).all() and torch.isfinite(e).all()
        ref = torch.logsumexp((z + bias).double(), 1)
        # the 200 finite terms' sum, plus one rounding of lse
        assert_within(lse, ref, sum_bound(200, 1.0) + 2 * EPS32 * (z.abs().max() + ref.abs()),
                      what=f"lse {backend}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op_dtype", [torch.float32, torch.bfloat16], ids=["fp32op", "bf16op"])
def test_g_written_over_z_equals_separate_buffer(backend, op_dtype):
    """G over Z's own bytes (how the chunk loop saves a (C, V) buffer) changes no value."""
    from grpo_lce._head import g_over_z

    gen = torch.Generator().manual_seed(7)
    C, V = 4, 20000  # several 8192-wide steps, V not a multiple of the block
    z = torch.randn(C, V, generator=gen) * 3
    y = torch.randint(0, V, (C,), generator=gen)
    alpha = torch.randn(C, generator=gen)
    sep = _run(backend, z.clone(), y, None, 1.0, op_dtype, alpha, None)
    zz = z.clone()
    g = g_over_z(zz, C, op_dtype)
    assert g.untyped_storage().data_ptr() == zz.untyped_storage().data_ptr()
    stats = row_softmax(zz, y, None, 1.0, backend=backend, g_out=g, alpha=alpha, want_argmax=True)
    for a, b in zip(stats[:3], sep[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(g.float(), sep[4].float(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_peaked_rows_keep_the_gradients_digits(backend):
    """G = p − e_y is invariant to a constant shift of a row's logits, and so is its fp32
    bound: a peaked row's p_y − 1 is small, and p_y may not carry an error of lse's size. The
    bound, relative to the row max m (p's exponent in the module docstring): z − m is one
    rounding of its own size (z given in fp32, no bias, τ = 1); l = Σ e^(z − m) has its V-term
    sum's rounding (sum_bound, each term ≤ 1) plus 2 ulp a term (exp of a rounded argument);
    log l one ulp; p = exp((z − m) − log l) moves by p times its exponent's error plus 2 ulp; G
    one rounding. The offsets (±2000: 50-nat logits at τ = 0.025) make an ulp of lse (2^-24
    |m|) in p_y exceed the bound."""
    gen = torch.Generator().manual_seed(11)
    C, V = 6, 5000
    z = torch.randn(C, V, generator=gen)
    y = torch.randint(0, V, (C,), generator=gen)
    peak = torch.tensor([11.0, 12.0, 13.0, 14.0, 16.0, 17.0])
    z[torch.arange(C), y] += peak
    z += torch.tensor([2e3, -2e3, 2e3, -2e3, 2e3, -2e3])[:, None]
    g = torch.empty(C, V)
    lse, *_ = row_softmax(z, y, None, 1.0, backend=backend, g_out=g)
    z64 = z.double()
    m = z64.amax(1, keepdim=True)
    zm = z64 - m
    log_l = torch.log(torch.exp(zm).sum(1, keepdim=True))
    p = torch.exp(zm - log_l)
    G64 = p - torch.nn.functional.one_hot(y, V).double()
    assert (p[torch.arange(C), y] > 0.85).all() and (p[torch.arange(C), y] < 0.9999).all()
    d_log_l = sum_bound(V, 1.0) + 2 * EPS32 * torch.exp(zm).sum(1, keepdim=True) + (
        EPS32 * log_l)
    d_exponent = EPS32 * zm.abs() + d_log_l + EPS32 * (zm - log_l).abs()
    bound = p * (d_exponent + 2 * EPS32) + EPS32 * G64.abs()
    assert_within(g, G64, bound, what=f"G of peaked rows ({backend})")
    assert_within(lse, (m + log_l)[:, 0], sum_bound(V, 1.0) + 2 * EPS32 * (m.abs() + log_l)[:, 0],
                  what=f"lse ({backend})")
