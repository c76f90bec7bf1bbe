"""trainers.sampling.kernels.rmsnorm: the fused residual add + RMSNorm against transformers'
LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm and MistralRMSNorm after the decoder layer's bf16 add.

    python -m pytest -q tests/test_decode_rmsnorm.py            # CPU (Triton's interpreter)
    python -m pytest -q -m gpu tests/test_decode_rmsnorm.py     # H100

Tolerance (module docstring): r' bit for bit; y within (2⁻⁷ + 2·2⁻⁸)(1 + 2⁻⁷)|y_ref| of the
module's output (a bf16 flip of the normalized value, then one rounding each), and within
(2·2⁻⁸ + 2⁻¹⁶ + (H + 8)·2⁻²⁴) |w · n*| of fp64 (n* = r' / √(mean r'² + ε) exact; ours rounds n
once and w · n once; the fp32 sum of H squares is off by at most H·2⁻²⁴ relative, the rsqrt
and the product by a few fp32 ulps). With `lora_a` (LoRA's t of y, `kernels.lora_t`): r' bit
for bit and y within the same bounds (the mean square summed in another order), and Σ_p T_p
within (H/P + P)·2⁻²⁴ · Σ_k |A_rk y_k| of the fp64 t of that y (each bf16 product exact in
fp32; a part sums H/P of them, then P parts are summed: each fp32 add errs by at most 2⁻²⁴ of
the running sum of magnitudes).
"""

import pytest
import torch

from trainers.sampling.kernels import lora_t as lora_t_mod
from trainers.sampling.kernels.rmsnorm import (
    LLAMA_STYLE_NORMS,
    add_rmsnorm,
    add_rmsnorm_torch,
    rmsnorm_params,
)
from trainers.sampling.kernels.split_sum import SplitSum

transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

NORMS = [LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm]
TOL_REF = (2.0**-7 + 2 * 2.0**-8) * (1 + 2.0**-7)


def _norm(cls, h, *, eps, weight_dtype, seed=0, device="cpu"):
    norm = cls(h, eps=eps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(h, generator=g))
    return norm.to(device=device, dtype=weight_dtype)


def _rows(m, h, *, seed=1, device="cpu"):
    """x, r (M, H) bf16; the last row ~1e-3 so that mean r'² ~ ε and ε matters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    r = 3 * torch.randn(m, h, generator=g)
    x[-1] *= 1e-3
    r[-1] *= 1e-3
    return x.to(device, torch.bfloat16), r.to(device, torch.bfloat16)


def _check(y, r_new, norm, x, r):
    r_ref = r + x  # the decoder layer's residual add
    with torch.no_grad():
        y_ref = norm(r_ref)
    assert torch.equal(r_new, r_ref)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    err = (y.double() - y_ref.double()).abs()
    bad = err > TOL_REF * y_ref.double().abs()
    assert not bad.any(), f"{bad.sum().item()} elements off, worst {err.max().item():.3g}"
    h64 = r_ref.double()
    n_star = h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    wn = norm.weight.double() * n_star
    err64 = (y.double() - wn).abs()
    tol64 = 2 * 2.0**-8 + 2.0**-16 + (x.shape[-1] + 8) * 2.0**-24
    assert (err64 <= tol64 * wn.abs() + 1e-30).all(), err64.max()


@pytest.mark.parametrize("cls", NORMS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("h", [896, 1000, 2048, 3584, 4095])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_matches_transformers_norm(cls, h, weight_dtype):
    """Odd and real H (Qwen2.5-0.5B 896, Qwen2.5-7B 3584, Llama-1B 2048); a bf16 weight, and the
    fp32 weight prepare_model_for_kbit_training leaves (y is then fp32, by type promotion)."""
    norm = _norm(cls, h, eps=1e-6 if cls is not LlamaRMSNorm else 1e-5,
                 weight_dtype=weight_dtype)
    x, r = _rows(7, h)
    weight, eps = rmsnorm_params(norm)
    y, r_new = add_rmsnorm(x, r, weight, eps)
    _check(y, r_new, norm, x, r)


def test_torch_path_is_transformers_bit_for_bit():
    norm = _norm(LlamaRMSNorm, 1000, eps=1e-5, weight_dtype=torch.bfloat16)
    x, r = _rows(5, 1000)
    y, r_new = add_rmsnorm_torch(x, r, norm.weight, norm.variance_epsilon)
    with torch.no_grad():
        assert torch.equal(y, norm(r + x))
    assert torch.equal(r_new, r + x)


def test_normalized_value_is_cast_back_before_the_weight():
    """LlamaRMSNorm casts the fp32 normalized value to the input dtype before `weight ·`: with an
    fp32 weight of ones, y (fp32) must hold bf16 values only."""
    norm = _norm(LlamaRMSNorm, 1000, eps=1e-5, weight_dtype=torch.float32)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    x, r = _rows(5, 1000)
    y, _ = add_rmsnorm(x, r, norm.weight, 1e-5)
    assert y.dtype == torch.float32
    assert torch.equal(y, y.to(torch.bfloat16).float())


def test_in_place_residual_3d_and_no_residual():
    norm = _norm(Qwen2RMSNorm, 640, eps=1e-6, weight_dtype=torch.bfloat16)
    x, r = _rows(6, 640)
    x3, r3 = x.reshape(2, 3, 640), r.reshape(2, 3, 640).clone()
    y, r_new = add_rmsnorm(x3, r3, norm.weight, 1e-6, residual_out=r3)
    assert r_new is r3
    _check(y.reshape(6, 640), r_new.reshape(6, 640), norm, x, r)
    y0, r0 = add_rmsnorm(x, None, norm.weight, 1e-6)
    assert r0 is x
    _check(y0, x, norm, x, torch.zeros_like(x))


@pytest.mark.parametrize("h", [640, 1000])
def test_ids_look_the_rows_up(h, device="cpu"):
    """`ids`: the rows of an embedding table looked up in the same launch, bit for bit the call
    on the looked-up rows (y and r' = table[ids], in ids' shape); an id outside the table
    reads a zero row (y 0) instead of reading out of it."""
    norm = _norm(LlamaRMSNorm, h, eps=1e-5, weight_dtype=torch.bfloat16, device=device)
    table, _ = _rows(37, h, device=device)
    ids = torch.tensor([[5], [0], [36], [5], [17]], device=device)
    y, r_new = add_rmsnorm(table, None, norm.weight, 1e-5, ids=ids)
    y_ref, _ = add_rmsnorm(table[ids[:, 0]], None, norm.weight, 1e-5)
    assert y.shape == r_new.shape == (5, 1, h)
    assert torch.equal(y[:, 0], y_ref) and torch.equal(r_new, table[ids])
    into = torch.empty_like(r_new)
    y_into, r_into = add_rmsnorm(table, None, norm.weight, 1e-5, ids=ids, residual_out=into)
    assert r_into is into and torch.equal(into, r_new) and torch.equal(y_into, y)
    outside = torch.tensor([3, 37, -1], device=device)
    y_out, r_out = add_rmsnorm(table, None, norm.weight, 1e-5, ids=outside)
    assert torch.equal(y_out[0], add_rmsnorm(table[3:4], None, norm.weight, 1e-5)[0][0])
    assert not y_out[1:].any() and not r_out[1:].any()


def _factors(j, h, *, device="cpu", seed=3):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(16, h, generator=g) / 8).to(device, torch.bfloat16)
                 for _ in range(j))


def _check_lora_t(t, y, a):
    """t (a LoraT) against the fp64 t of y (module docstring's bound), and its bookkeeping."""
    y2 = y.reshape(-1, y.shape[-1]).double()
    ref = torch.cat([aj.double() @ y2.T for aj in a])  # (J·R, M)
    mag = torch.cat([aj.double().abs() @ y2.abs().T for aj in a])
    parts = t.parts.shape[0]
    got = t.parts.double().sum(0)
    bound = (y.shape[-1] / parts + parts) * 2.0**-24 * mag
    err = (got - ref).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"worst ({worst}): {err.flatten()[worst]} > {bound.flatten()[worst]}"
    assert t.parts.dtype == torch.float32 and t.parts.shape[1:] == ref.shape
    assert t.x_ptr == y.data_ptr() and t.a == a


@pytest.mark.parametrize("h,m,j", [(1000, 5, 2), (2048, 8, 3), (640, 1, 1)])
def test_lora_t_parts(h, m, j, device="cpu"):
    """`lora_a`: y and r' within the module's bounds of transformers' norm (SplitSum input, a
    residual; and the embedding lookup), and t's parts sum to the fp64 x @ Aᵀ of that y;
    ragged H (a last part past H), one to three factors."""
    norm = _norm(LlamaRMSNorm, h, eps=1e-5, weight_dtype=torch.bfloat16, device=device)
    x, r = _rows(m, h, device=device)
    a = _factors(j, h, device=device)
    parts = torch.randn(2, m, h, generator=torch.Generator().manual_seed(4)).to(device)
    for delta in (x, SplitSum(parts, None, torch.bfloat16, h)):
        y, r_new, t = add_rmsnorm(delta, r, norm.weight, 1e-5, lora_a=a)
        plain = delta if isinstance(delta, torch.Tensor) else delta.materialize()
        _check(y, r_new, norm, plain, r)
        _check_lora_t(t, y, a)
    ids = torch.arange(m, device=device)[:, None] * 3 % m  # rows of x, some twice
    y, r_new, t = add_rmsnorm(x, None, norm.weight, 1e-5, ids=ids, lora_a=a)
    assert y.shape == r_new.shape == (m, 1, h)
    _check(y[:, 0], r_new[:, 0], norm, x[ids[:, 0]], torch.zeros_like(x[:m]))
    _check_lora_t(t, y, a)


def test_lora_t_bad_inputs():
    """lora_a's factors checked by name; r' into residual_out refused (the row's programs read
    the residual whole); a t refused by a launch on another x or other factors."""
    x, r = _rows(2, 64)
    w = torch.ones(64, dtype=torch.bfloat16)
    a = _factors(2, 64)
    with pytest.raises(ValueError, match=r"lora_a\[1\] is \(16, 32\)"):
        add_rmsnorm(x, r, w, 1e-6, lora_a=(a[0], a[1][:, :32]))
    with pytest.raises(ValueError, match="lora_a holds 4 factors"):
        add_rmsnorm(x, r, w, 1e-6, lora_a=a * 2)
    with pytest.raises(ValueError, match="lora_a with residual_out"):
        add_rmsnorm(x, r, w, 1e-6, lora_a=a, residual_out=r)
    y, _, t = add_rmsnorm(x, r, w, 1e-6, lora_a=a)
    t.check(y, list(a))
    with pytest.raises(ValueError, match="lora_t was formed from another x"):
        t.check(y.clone(), list(a))
    with pytest.raises(ValueError, match="lora_t was formed from another x"):
        t.check(y, [a[1], a[0]])
    with pytest.raises(ValueError, match="lora_t was formed from another x"):
        t.check(y, [a[0], None])
    assert lora_t_mod.lora_t_torch(y, a).shape == (1, 32, 2)


def test_bad_inputs_and_other_norms():
    x, r = _rows(2, 64)
    with pytest.raises(ValueError, match=r"weight has shape \(32,\)"):
        add_rmsnorm(x, r, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="residual is"):
        add_rmsnorm(x, r.float(), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="ids given"):
        add_rmsnorm(x, r, torch.ones(64), 1e-6, ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="ids is torch.float32"):
        add_rmsnorm(x, None, torch.ones(64), 1e-6, ids=torch.zeros(2))
    with pytest.raises(ValueError, match="LayerNorm"):
        rmsnorm_params(torch.nn.LayerNorm(64))
    assert len(LLAMA_STYLE_NORMS) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("cls", NORMS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("h", [896, 1536, 2048, 3584, 4096, 5000])
@pytest.mark.parametrize("m", [1, 8, 64, 256])
def test_matches_transformers_norm_gpu(cls, h, m):
    norm = _norm(cls, h, eps=1e-5, weight_dtype=torch.bfloat16, device="cuda")
    x, r = _rows(m, h, device="cuda")
    y, r_new = add_rmsnorm(x, r, norm.weight, norm.variance_epsilon)
    _check(y, r_new, norm, x, r)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [2048, 4096])
def test_ids_look_the_rows_up_gpu(h):
    test_ids_look_the_rows_up(h, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("h,m,j", [(4096, 8, 3), (2048, 3, 2), (5000, 1, 1)])
def test_lora_t_parts_gpu(h, m, j):
    test_lora_t_parts(h, m, j, device="cuda")
