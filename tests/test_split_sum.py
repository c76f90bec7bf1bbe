"""trainers.sampling.kernels.split_sum: a split projection's partials summed by the kernel that
reads its output (add_rmsnorm, rope_cache_write) give the same bits as the projection's own sum.

    python -m pytest -q tests/test_split_sum.py            # CPU (Triton's interpreter)
    python -m pytest -q -m gpu tests/test_split_sum.py     # H100

No tolerance: every comparison is bit for bit. The sum is the same fp32 additions in the same
order (from zero, split 0 first, then the bias) and one rounding wherever it is formed.
"""

import pytest
import torch

from trainers.sampling.kernels import rmsnorm, split_sum
from trainers.sampling.kernels.rmsnorm import add_rmsnorm
from trainers.sampling.kernels.rope import rope_cache_write
from trainers.sampling.kernels.split_sum import SplitSum

GPU = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _split_sums(s, m, widths, *, bias=True, seed=0, device="cpu"):
    """SplitSums of projections side by side in one (S, M, Σ N) fp32 buffer, as a grouped launch
    leaves them: partials of mixed signs and magnitudes (so the order of the sum matters), bf16
    biases."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(s, m, sum(widths), generator=g)
    buf *= torch.logspace(-3, 2, sum(widths))[None, None] * (1 + torch.arange(s))[:, None, None]
    buf = buf.to(device)
    out, col = [], 0
    for n in widths:
        b = (torch.randn(n, generator=g) * 4).to(torch.bfloat16).to(device) if bias else None
        out.append(SplitSum(buf[:, :, col:col + n], b, torch.bfloat16, n))
        col += n
    return out


def test_materialize_is_the_sum_in_split_order():
    """The torch reference: ((0 + P_0) + P_1) + ... + bias in fp32, rounded once to bf16 (an
    fp64 sum rounded to fp32 first can differ; this pins the order the kernels follow)."""
    (y,) = _split_sums(3, 5, [40])
    acc = torch.zeros(5, 40)
    for s in range(3):
        acc = acc + y.parts[s]
    assert torch.equal(y.materialize(), (acc + y.bias.float()).to(torch.bfloat16))
    assert y.view(5, 1, 40).materialize().shape == (5, 1, 40)
    assert y.view(5, 4, 10).shape == (5, 4, 10) and y.view(5, 4, 10).dim() == 3


@pytest.mark.parametrize("device", ["cpu"] + GPU)
@pytest.mark.parametrize("splits,h,bias", [(2, 128, False), (3, 200, True), (4, 2048, True)])
def test_add_rmsnorm_sums_a_split_sum(device, splits, h, bias):
    """add_rmsnorm(SplitSum, residual): y and r' bit for bit those of the materialized delta, with
    a (M, 1, H) view (the decode step's shape) and the in-place residual update."""
    (x,) = _split_sums(splits, 3, [h], bias=bias, device=device)
    x = x.view(3, 1, h)
    g = torch.Generator().manual_seed(1)
    r = (3 * torch.randn(3, 1, h, generator=g)).to(torch.bfloat16).to(device)
    w = (1 + 0.3 * torch.randn(h, generator=g)).to(torch.bfloat16).to(device)
    before = split_sum.CONSUMED["add_rmsnorm"]
    y, r_new = add_rmsnorm(x, r, w, 1e-5)
    assert split_sum.CONSUMED["add_rmsnorm"] == before + 1  # the SplitSum path ran
    y_ref, r_ref = add_rmsnorm(x.materialize(), r, w, 1e-5)
    assert torch.equal(r_new, r_ref) and torch.equal(y, y_ref)
    r_in = r.clone()
    _, r_out = add_rmsnorm(x, r_in, w, 1e-5, residual_out=r_in)
    assert r_out is r_in and torch.equal(r_in, r_ref)


def test_add_rmsnorm_torch_path_materializes(monkeypatch):
    """Off CUDA and the interpreter, add_rmsnorm's torch ops take the materialized delta."""
    (x,) = _split_sums(2, 3, [64])
    r = torch.randn(3, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    monkeypatch.setattr(rmsnorm, "interpreting", lambda: False)
    y, r_new = add_rmsnorm(x, r, w, 1e-5)
    y_ref, r_ref = rmsnorm.add_rmsnorm_torch(x.materialize(), r, w, 1e-5)
    assert torch.equal(y, y_ref) and torch.equal(r_new, r_ref)


def test_add_rmsnorm_split_sum_needs_a_residual():
    (x,) = _split_sums(2, 3, [64])
    with pytest.raises(ValueError, match="SplitSum"):
        add_rmsnorm(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-5)


@pytest.mark.parametrize("device", ["cpu"] + GPU)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("splits,bias", [(2, True), (3, False)])
def test_rope_cache_write_sums_split_sums(device, norm, splits, bias):
    """rope_cache_write on q/k/v SplitSums (column slices of one buffer, viewed per head, with
    biases as Qwen2's): rotated q and both caches bit for bit those of the materialized
    q/k/v, with Qwen3's q/k norms and without; a plain tensor beside SplitSums too."""
    B, Hq, Hkv, D, M = 3, 8, 2, 32, 6
    q, k, v = (t.view(B, -1, D) for t in _split_sums(
        splits, B, [Hq * D, Hkv * D, Hkv * D], bias=bias, seed=splits, device=device))
    g = torch.Generator().manual_seed(2)
    ang = torch.randn(B, D // 2, generator=g).repeat(1, 2)
    cos, sin = (f(ang).to(torch.bfloat16).to(device) for f in (torch.cos, torch.sin))
    slots = torch.tensor([0, 3, 5], device=device)
    norms = {}
    if norm:
        norms = {f"{w}_norm": ((1 + 0.2 * torch.randn(D, generator=g)).to(torch.bfloat16)
                               .to(device), 1e-6) for w in "qk"}
    caches = [torch.zeros(B, Hkv, M, D, dtype=torch.bfloat16, device=device) for _ in range(4)]
    before = split_sum.CONSUMED["rope_cache_write"]
    out = rope_cache_write(q, k, v, cos, sin, caches[0], caches[1], slots, **norms)
    assert split_sum.CONSUMED["rope_cache_write"] == before + 3
    qm, km, vm = (t.materialize() for t in (q, k, v))
    ref = rope_cache_write(qm, km, vm, cos, sin, caches[2], caches[3], slots, **norms)
    assert torch.equal(out, ref)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    mixed = rope_cache_write(qm, k, vm, cos, sin, caches[0], caches[1], slots, **norms)
    assert torch.equal(mixed, ref) and torch.equal(caches[0], caches[2])


@pytest.mark.parametrize("device", ["cpu"] + GPU)
@pytest.mark.parametrize("cfg", [
    {"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": 4, "PREFETCH": True, "REG_TILE": False},
    {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "PREFETCH": True, "REG_TILE": True},
    {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "PREFETCH": True, "REG_TILE": True},
], ids=["blocks-split4", "reg-tile-split2", "no-split"])
def test_deferred_projections_sum_to_their_outputs(device, cfg):
    """linear4bit_lora_group(defer_sum=True) over q/k/v-like parts with biases and LoRA: where
    the launch splits K, SplitSums whose sums are the launch's own outputs bit for bit; without
    a split, the outputs themselves."""
    from test_decode_linear import _inputs, _quantize

    from trainers.sampling.kernels.linear4bit import LinearPart, Packed4bit, linear4bit_lora_group

    k, m = 512, 5
    parts = []
    for i, n in enumerate((96, 40, 72)):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, seed=10 + i, device=device)
        _, a, b, bias = _inputs(m, n, k, 8, seed=20 + i, device=device)
        parts.append(LinearPart(Packed4bit.from_quant_state(packed, qs), bias, a, b, 0.5 + i))
    x = _inputs(m, 8, k, 8, seed=3, device=device)[0]
    ys = linear4bit_lora_group(x, parts, config=cfg)
    deferred = linear4bit_lora_group(x, parts, config=cfg, defer_sum=True)
    for y, d in zip(ys, deferred):
        if cfg["SPLIT_K"] > 1:
            assert isinstance(d, SplitSum) and d.splits == cfg["SPLIT_K"]
            d = d.materialize()
        assert torch.equal(d, y)
