"""The Triton row kernel (interpreted on CPU) against its torch twin and against fp64.

Run: python -m pytest tests/test_row_softmax.py -q
"""

import pytest
import torch

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
    names = ["lse", "z_y", "entropy", "argmax", "G", "E"]
    for name, a, b in zip(names, tri, ref):
        if name == "argmax":
            assert torch.equal(a, b)
            continue
        # fp32 reductions in a different order: a few ulp; bf16 operands: one bf16 ulp
        tol = 2e-5 if (a.dtype == torch.float32) else 8e-3
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)
    # and the torch twin against fp64
    z64 = (z.double() + bias.double()) * inv_tau
    lse64 = torch.logsumexp(z64, 1)
    torch.testing.assert_close(ref[0].double(), lse64, rtol=0, atol=1e-5)
    p = torch.exp(z64 - lse64[:, None])
    ent64 = lse64 - (p * z64).sum(1)
    torch.testing.assert_close(tri[2].double(), ent64, rtol=0, atol=1e-5)
    G64 = alpha.double()[:, None] * (p - torch.nn.functional.one_hot(y, V).double()) + \
        beta.double()[:, None] * p * (z64 - (p * z64).sum(1, keepdim=True))
    torch.testing.assert_close(tri[4].double(), G64, rtol=0,
                               atol=(1e-5 if op_dtype == torch.float32 else 2e-2) * G64.abs().max().item())


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
        ref = torch.logsumexp(z + bias, 1)
        torch.testing.assert_close(lse, ref, rtol=1e-6, atol=1e-6)


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
