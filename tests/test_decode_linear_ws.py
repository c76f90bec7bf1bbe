"""trainers.sampling.kernels.linear4bit_ws: the warp-specialized decode linear (sm_90, Gluon).

CPU: where the path runs (`reason`) and its split rule; the kernel's sm_90 compile is
tests/_compile_decode_kernels.py's. GPU (`-m gpu`, an H100): the kernel through
`linear4bit_lora` / `decode_linear` (the launcher's own choice) against the same sum in fp64
and against the modules' forward, with the tolerances of tests/test_decode_linear.py, at odd
rows, an N that is not a multiple of 64, an odd number of K steps, every real 1B / 8B layer
shape, with and without LoRA and double quant; each test asserts that the kernel ran.

    python -m pytest -q tests/test_decode_linear_ws.py
    python -m pytest -q -m gpu tests/test_decode_linear_ws.py
"""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from bitsandbytes import functional as bnbF
from test_decode_linear import (
    S_U_PAIR,
    _check,
    _fp64,
    _inputs,
    _lora_module,
    _module_bound_check,
    _quantize,
)

from trainers.sampling.kernels import linear4bit, linear4bit_ws, lora_t, pdl
from trainers.sampling.kernels.linear4bit import Packed4bit, decode_linear, linear4bit_lora
from trainers.sampling.kernels.rmsnorm import add_rmsnorm
from trainers.sampling.kernels.split_sum import SplitSum

gpu = pytest.mark.skipif(not (torch.cuda.is_available()
                              and torch.cuda.get_device_capability() == (9, 0)),
                         reason="needs an sm_90 GPU")


def _part(packed, qs, a=None, b=None, bias=None):
    return linear4bit.LinearPart(Packed4bit.from_quant_state(packed, qs), bias, a, b, 2.0)


def test_reason_names_what_keeps_the_path_off():
    """Off CUDA, more than three projections, a gate/up launch of one projection, an explicit
    config or the environment switch, `reason` says so (the register tile then runs)."""
    packed, qs = _quantize(128, 256, quant_type="nf4", double=True)
    x, a, b, _ = _inputs(8, 128, 256, 16)
    part = _part(packed, qs, a, b)
    assert "CUDA" in linear4bit_ws.reason(x, [part], False, None)
    assert "CUDA" in linear4bit_ws.reason(x, [part] * 3, False, None)  # q/k/v: grouped
    assert "1 to 3" in linear4bit_ws.reason(x, [part] * 4, False, None)
    assert "gate/up" in linear4bit_ws.reason(x, [part], True, None)
    assert "config" in linear4bit_ws.reason(x, [part], False, {"SPLIT_K": 1})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(linear4bit_ws.ENV, "0")
        assert linear4bit_ws.ENV in linear4bit_ws.reason(x, [part], False, None)


def test_split_rule():
    """The smallest power of two that fills 0.9 of the SMs with 64-row CTAs (1.6 where the
    launch takes the pair table), at most 8 and at most half the 256-column steps."""
    assert linear4bit_ws.split_rule(14336, 4096, 132) == 1  # 224 tiles (pair table)
    assert linear4bit_ws.split_rule(4096, 14336, 132) == 4  # 64 tiles (pair table)
    assert linear4bit_ws.split_rule(4096, 14336, 132, linear4bit_ws.CTAS_PER_SM) == 2
    assert linear4bit_ws.split_rule(2048, 2048, 132) == 4  # 32 tiles, 8 steps
    assert linear4bit_ws.split_rule(512, 2048, 132) == 4  # 8 tiles, capped by 8 steps / 2
    assert linear4bit_ws.split_rule(1024, 4096, 132) == 8  # 16 tiles
    assert linear4bit_ws.split_rule(64, 256, 132) == 1  # one step: one split


def test_pair_table_rule():
    """The pair table where a projection's lookups come to at least 16 steps (64 rows x 256
    columns) a SM: 8B's gate/up and down; not its q/k/v, o, nor any 1B launch."""
    rule = linear4bit_ws.pair_table_rule
    assert rule(224, 4096, 132) and rule(64, 14336, 132)  # 8B gate/up, down
    assert not rule(96, 4096, 132) and not rule(64, 4096, 132)  # 8B q/k/v, o
    assert not rule(128, 2048, 132) and not rule(32, 8192, 132)  # 1B gate/up, down
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear4bit_ws, "PAIR_TABLE", 0)
        assert not rule(224, 4096, 132)
        mp.setattr(linear4bit_ws, "PAIR_TABLE", 2)
        assert rule(1, 256, 132)
        mp.setattr(linear4bit_ws, "PAIR_TABLE", 1)
        mp.setenv(linear4bit_ws.PAIR_TABLE_ENV, "0")  # the user's switch: round(W) exactly
        assert not rule(224, 4096, 132)


def test_ring_depth_rule():
    """Three stages for a gate/up + silu · mul launch through the pair table (the 8B's), two
    for every other launch (1B gate/up, split projections)."""
    stages = linear4bit_ws.stages
    assert stages(glu=True, pair_table=True) == linear4bit_ws.GLU_PAIR_STAGES == 3
    assert stages(glu=True, pair_table=False) == stages(glu=False, pair_table=True) == 2
    assert stages(glu=False, pair_table=False) == linear4bit_ws.STAGES == 2


# ---------------------------------------------------------------------------------------- GPU

def _launches():
    return sum(linear4bit_ws.LAUNCHES.values())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("quant_type,double,blocksize", [
    ("nf4", True, 64), ("nf4", True, 128), ("fp4", False, 64), ("nf4", False, 256)])
@pytest.mark.parametrize("n,k", [(200, 1280), (2048, 2048), (512, 2048), (8192, 2048),
                                 (2048, 8192), (4096, 4096), (1024, 4096), (14336, 4096),
                                 (4096, 14336)])
@pytest.mark.parametrize("lookup", ["pair_table", "byte_planes"])
def test_matches_fp64_gpu(quant_type, double, blocksize, n, k, lookup, monkeypatch):
    """At M = 1, 3, 8, with and without a rank-16 bf16 LoRA term, each lookup: within u·|y| +
    (s_u·u + 2·K_eff·2⁻²⁴)·S of the fp64 sum of the bf16 operands (one rounding of fp32 sums;
    the pair table's weights round(code) · scale within S_U_PAIR·u of round(W), s_u =
    S_U_PAIR; the register tables' are round(W), s_u = 0), the kernel counted."""
    monkeypatch.setattr(linear4bit_ws, "PAIR_TABLE", 2 if lookup == "pair_table" else 0)
    s_u = S_U_PAIR if lookup == "pair_table" else 0
    key = "pair table" if lookup == "pair_table" else "register tables"
    packed, qs = _quantize(n, k, quant_type=quant_type, double=double, blocksize=blocksize,
                           device="cuda")
    w = Packed4bit.from_quant_state(packed, qs)
    w_bf16 = bnbF.dequantize_4bit(packed, qs)
    for m in (1, 3, 8):
        x, a, b, _ = _inputs(m, n, k, 16, device="cuda")
        for lora in (False, True):
            before, lookups = _launches(), linear4bit_ws.LOOKUPS[key]
            kw = {"lora_a": a, "lora_b": b, "scaling": 2.0} if lora else {}
            ours = linear4bit_lora(x, w, **kw)
            assert linear4bit_ws.LOOKUPS[key] == lookups + 1, dict(linear4bit_ws.LOOKUPS)
            assert _launches() == before + 1, linear4bit_ws.reason(
                x, [linear4bit.LinearPart(w, None, a if lora else None, b if lora else None,
                                          2.0)], False, None)
            y, big_s = _fp64(x, w_bf16, None, a if lora else None, b if lora else None, 2.0)
            splits = linear4bit_ws.split_rule(n, k, torch.cuda.get_device_properties(0)
                                              .multi_processor_count)
            _check(ours, y, big_s, k_eff=k + 16 + 4 + splits, rel_u=1, s_u=s_u,
                   what=f"{quant_type} double={double} bs={blocksize} N={n} K={k} M={m} "
                        f"lora={lora} {lookup}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_module_and_deferred_sum_gpu(m, bias):
    """decode_linear(x, lora.Linear4bit with or without a bias) takes the kernel: within the
    bf16 contract of the module's forward (bitsandbytes' matmul with its bias, PEFT's LoRA
    added after); with defer_sum a split launch hands its partials on, and their sum is the
    tensor's bits."""
    mod = _lora_module(2048, 8192, bias=bias, device="cuda")
    x = _inputs(m, 2048, 8192, 16, device="cuda")[0]
    before = _launches()
    ours = decode_linear(x, mod)
    assert _launches() == before + 1
    with torch.no_grad():
        ref = mod(x)
    _module_bound_check(ours, mod, x, ref, f"M={m} bias={bias}")
    deferred = decode_linear(x, mod, defer_sum=True)
    assert isinstance(deferred, SplitSum) and deferred.splits > 1
    assert torch.equal(deferred.materialize(), ours)


@pytest.mark.gpu
@gpu
def test_switch_and_fallbacks_gpu():
    """GRPO_LCE_WS_LINEAR=0, 9 rows and fp32 LoRA factors take the register tile (no launch of
    this kernel), each within the same fp64 bound."""
    n, k = 1024, 2048
    packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda")
    w = Packed4bit.from_quant_state(packed, qs)
    w_bf16 = bnbF.dequantize_4bit(packed, qs)
    cases = []
    x, a, b, _ = _inputs(8, n, k, 16, device="cuda")
    x9 = _inputs(9, n, k, 16, device="cuda")[0]
    cases.append(("9 rows", x9, {"lora_a": a, "lora_b": b}))
    a32, b32 = a.float(), b.float()
    cases.append(("fp32 factors", x, {"lora_a": a32, "lora_b": b32}))
    for what, xx, kw in cases:
        before = _launches()
        ours = linear4bit_lora(xx, w, scaling=2.0, **kw)
        assert _launches() == before, what
        y, big_s = _fp64(xx, w_bf16, None, kw["lora_a"], kw["lora_b"], 2.0)
        _check(ours, y, big_s, k_eff=k + 20 + 32, rel_u=1, s_u=0, what=what)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(linear4bit_ws.ENV, "0")
        before = _launches()
        ours = linear4bit_lora(x, w, lora_a=a, lora_b=b, scaling=2.0)
        assert _launches() == before
        y, big_s = _fp64(x, w_bf16, None, a, b, 2.0)
        _check(ours, y, big_s, k_eff=k + 20 + 32, rel_u=1, s_u=0, what="switched off")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("lookup", ["pair_table", "byte_planes"])
def test_bias_gpu(lora, lookup, monkeypatch):
    """A bias (Qwen's q/k/v have one) on the kernel: one projection of one split and of a split K
    (its partials summed with the bias, or handed on with it), q/k/v in one launch (odd N), and
    a gate/up + silu · mul launch; each output within the fp64 bound of the sum with the bias
    at M = 1, 3, 8, the launches counted; the deferred sums give the plain launch's bits, the
    gate/up launch its projections' at its one split. Each lookup in every launch (and only it:
    counted)."""
    monkeypatch.setattr(linear4bit_ws, "PAIR_TABLE", 2 if lookup == "pair_table" else 0)
    key, other = (("pair table", "register tables") if lookup == "pair_table"
                  else ("register tables", "pair table"))
    lookups = dict(linear4bit_ws.LOOKUPS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((8192, 2048), (1024, 2048)):  # one split; split K
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda")
        w, w_bf16 = Packed4bit.from_quant_state(packed, qs), bnbF.dequantize_4bit(packed, qs)
        for m in (1, 3, 8):
            x, a, b, bias = _inputs(m, n, k, 16, device="cuda")
            a, b = (a, b) if lora else (None, None)
            part = linear4bit.LinearPart(w, bias, a, b, 2.0)
            before = _launches()
            (ours,) = linear4bit.linear4bit_lora_group(x, [part])
            assert _launches() == before + 1, linear4bit_ws.reason(x, [part], False, None)
            y, big_s = _fp64(x, w_bf16, bias, a, b, 2.0)
            _check(ours, y, big_s, k_eff=k + 16 + 5 + linear4bit_ws.split_rule(n, k, sms),
                   rel_u=1, s_u=S_U_PAIR, what=f"N={n} K={k} M={m}")
            (deferred,) = linear4bit.linear4bit_lora_group(x, [part], defer_sum=True)
            got = deferred.materialize() if isinstance(deferred, SplitSum) else deferred
            assert torch.equal(got, ours), f"deferred N={n} M={m}"
    k, ns = 1280, (200, 72, 136)
    parts, refs = [], []
    for i, n in enumerate(ns):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=i)
        _, a, b, bias = _inputs(1, n, k, 16, device="cuda", seed=10 + i)
        parts.append(linear4bit.LinearPart(Packed4bit.from_quant_state(packed, qs), bias,
                                           a if lora else None, b if lora else None, 0.5 + i))
        refs.append(bnbF.dequantize_4bit(packed, qs))
    splits = linear4bit_ws.split_rule(64 * sum(-(-n // 64) for n in ns), k, sms)
    for m in (1, 3, 8):
        x = _inputs(m, ns[0], k, 16, device="cuda", seed=20)[0]
        before = _launches()
        ys = linear4bit.linear4bit_lora_group(x, parts)
        assert _launches() == before + 1, linear4bit_ws.reason(x, parts, False, None)
        for p, y_ours, w_bf16 in zip(parts, ys, refs):
            y, big_s = _fp64(x, w_bf16, p.bias, p.lora_a, p.lora_b, p.scaling)
            _check(y_ours, y, big_s, k_eff=k + 16 + 5 + splits, rel_u=1, s_u=S_U_PAIR,
                   what=f"q/k/v N={p.weight.shape[0]} M={m}")
        for d, y_ours in zip(linear4bit.linear4bit_lora_group(x, parts, defer_sum=True), ys):
            assert torch.equal(d.materialize() if isinstance(d, SplitSum) else d, y_ours)
    n, k = 8192, 2048  # gate/up: one split
    g_u = []
    for i in range(2):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=30 + i)
        _, a, b, bias = _inputs(1, n, k, 16, device="cuda", seed=40 + i)
        g_u.append(linear4bit.LinearPart(Packed4bit.from_quant_state(packed, qs), bias,
                                         a if lora else None, b if lora else None, 2.0))
    for m in (1, 3, 8):
        x = _inputs(m, n, k, 16, device="cuda", seed=50)[0]
        before = linear4bit_ws.LAUNCHES["silu_mul"]
        h = linear4bit.linear4bit_lora_silu_mul(x, *g_u)
        assert linear4bit_ws.LAUNCHES["silu_mul"] == before + 1
        # each projection alone at the gate/up launch's one split (its own split rule may split
        # K, another order of the fp32 sums, where the pair table aims at more CTAs)
        yg, yu = (linear4bit_ws._launch(x, [p], False, False, split=1)[0] for p in g_u)
        assert torch.equal(h, torch.nn.functional.silu(yg) * yu), f"gate/up M={m}"
    assert linear4bit_ws.LOOKUPS[key] > lookups.get(key, 0)
    assert linear4bit_ws.LOOKUPS[other] == lookups.get(other, 0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(8192, 2048), (14336, 4096)])
@pytest.mark.parametrize("lora", [False, True])
def test_silu_mul_is_torchs_on_the_projections_gpu(n, k, lora):
    """The gate/up launch (one CTA streams both projections of its columns) gives torch's
    F.silu(gate) * up on the two projections as this kernel computes them alone, bit for bit,
    at M = 1, 3, 8; and the launch is counted."""
    gp, gqs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=0)
    up, uqs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=1)
    for m in (1, 3, 8):
        x, a, b, _ = _inputs(m, n, k, 16, device="cuda", seed=2)
        _, a2, b2, _ = _inputs(m, n, k, 16, device="cuda", seed=3)
        g = linear4bit.LinearPart(Packed4bit.from_quant_state(gp, gqs), None,
                                  a if lora else None, b if lora else None, 2.0)
        u = linear4bit.LinearPart(Packed4bit.from_quant_state(up, uqs), None,
                                  a2 if lora else None, b2 if lora else None, 0.5)
        before = dict(linear4bit_ws.LAUNCHES)
        h = linear4bit.linear4bit_lora_silu_mul(x, g, u)
        assert linear4bit_ws.LAUNCHES["silu_mul"] == before.get("silu_mul", 0) + 1
        yg = linear4bit.linear4bit_lora_group(x, [g])[0]
        yu = linear4bit.linear4bit_lora_group(x, [u])[0]
        assert linear4bit_ws.LAUNCHES["whole"] == before.get("whole", 0) + 2
        assert torch.equal(h, torch.nn.functional.silu(yg) * yu), f"M={m}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,ns", [(2048, (2048, 512, 512)), (4096, (4096, 1024, 1024)),
                                  (1280, (200, 72, 136))])
@pytest.mark.parametrize("lora", [False, True])
def test_grouped_qkv_gpu(k, ns, lora):
    """q/k/v in one launch (each CTA a tile of one projection): each output within the fp64
    bound at M = 1, 3, 8, the launch counted as grouped; with defer_sum the partials' sums are
    the same bits; the 1B and 8B shapes and odd N (tiles that end inside a segment)."""
    parts, refs = [], []
    for i, n in enumerate(ns):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=i)
        _, a, b, _ = _inputs(1, n, k, 16, device="cuda", seed=10 + i)
        parts.append(linear4bit.LinearPart(Packed4bit.from_quant_state(packed, qs), None,
                                           a if lora else None, b if lora else None,
                                           0.5 + i))
        refs.append(bnbF.dequantize_4bit(packed, qs))
    splits = linear4bit_ws.split_rule(64 * sum(-(-n // 64) for n in ns), k,
                                      torch.cuda.get_device_properties(0).multi_processor_count)
    for m in (1, 3, 8):
        x = _inputs(m, ns[0], k, 16, device="cuda", seed=20)[0]
        before = _launches()
        ys = linear4bit.linear4bit_lora_group(x, parts)
        assert _launches() == before + 1, linear4bit_ws.reason(x, parts, False, None)
        assert any(key.endswith("x3") and v for key, v in linear4bit_ws.LAUNCHES.items())
        for p, y_ours, w_bf16 in zip(parts, ys, refs):
            y, big_s = _fp64(x, w_bf16, None, p.lora_a, p.lora_b, p.scaling)
            _check(y_ours, y, big_s, k_eff=k + 16 + 4 + splits, rel_u=1, s_u=S_U_PAIR,
                   what=f"N={p.weight.shape[0]} K={k} M={m} lora={lora}")
        deferred = linear4bit.linear4bit_lora_group(x, parts, defer_sum=True)
        for d, y_ours in zip(deferred, ys):
            got = d.materialize() if isinstance(d, SplitSum) else d
            assert torch.equal(got, y_ours)


def _normed(m, k, factors, seed):
    """add_rmsnorm's (y, LoraT) for random rows: the input a q/k/v or gate/up launch reads in
    a decode step, and LoRA's t of it for `factors`."""
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(m, k, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    w = (1 + 0.3 * torch.randn(k, generator=g)).to("cuda", torch.bfloat16)
    y, _, t = add_rmsnorm(x, r, w, 1e-5, lora_a=factors)
    return y, t


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,ns", [(2048, (2048, 512, 512)), (4096, (4096, 1024, 1024)),
                                  (1280, (200, 72, 136)), (14336, (4096,))])
def test_lora_t_from_the_norm_gpu(k, ns):
    """t = x @ Aᵀ given by add_rmsnorm (`lora_t`): each output within the fp64 bound at M = 1,
    3, 8 (t's P parts add P terms to K_eff), the launch counted as one that took t; with
    defer_sum the same bits once summed; the 1B / 8B q/k/v, odd N and a split launch (down's
    K, whose splits past the first add no LoRA term)."""
    parts, refs = [], []
    for i, n in enumerate(ns):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=i)
        _, a, b, _ = _inputs(1, n, k, 16, device="cuda", seed=10 + i)
        parts.append(linear4bit.LinearPart(Packed4bit.from_quant_state(packed, qs), None, a, b,
                                           0.5 + i))
        refs.append(bnbF.dequantize_4bit(packed, qs))
    splits = linear4bit_ws.split_rule(64 * sum(-(-n // 64) for n in ns), k,
                                      torch.cuda.get_device_properties(0).multi_processor_count)
    for m in (1, 3, 8):
        x, t = _normed(m, k, tuple(p.lora_a for p in parts), seed=20 + m)
        given = linear4bit_ws.LAUNCHES["lora t given"]
        ys = linear4bit.linear4bit_lora_group(x, parts, lora_t=t)
        assert linear4bit_ws.LAUNCHES["lora t given"] == given + 1, dict(linear4bit_ws.LAUNCHES)
        for p, y_ours, w_bf16 in zip(parts, ys, refs):
            y, big_s = _fp64(x, w_bf16, None, p.lora_a, p.lora_b, p.scaling)
            _check(y_ours, y, big_s, k_eff=k + 16 + 4 + splits + t.parts.shape[0], rel_u=1,
                   s_u=S_U_PAIR, what=f"N={p.weight.shape[0]} K={k} M={m} lora_t")
        deferred = linear4bit.linear4bit_lora_group(x, parts, defer_sum=True, lora_t=t)
        for d, y_ours in zip(deferred, ys):
            got = d.materialize() if isinstance(d, SplitSum) else d
            assert torch.equal(got, y_ours)
    with pytest.raises(ValueError, match="lora_t was formed from another x"):
        linear4bit.linear4bit_lora_group(x.clone(), parts, lora_t=t)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(8192, 2048), (14336, 4096)])
def test_lora_t_silu_mul_gpu(n, k):
    """The gate/up + silu · mul launch with t from add_rmsnorm: torch's F.silu(gate) * up on
    the two projections as this kernel computes them alone with their own t (each projection's
    t from the same norm: the same parts, so the same bits), at M = 1, 3, 8; counted."""
    gp, gqs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=0)
    up, uqs = _quantize(n, k, quant_type="nf4", double=True, device="cuda", seed=1)
    for m in (1, 3, 8):
        _, a, b, _ = _inputs(m, n, k, 16, device="cuda", seed=2)
        _, a2, b2, _ = _inputs(m, n, k, 16, device="cuda", seed=3)
        g = linear4bit.LinearPart(Packed4bit.from_quant_state(gp, gqs), None, a, b, 2.0)
        u = linear4bit.LinearPart(Packed4bit.from_quant_state(up, uqs), None, a2, b2, 0.5)
        x, t = _normed(m, k, (a, a2), seed=30 + m)
        given = linear4bit_ws.LAUNCHES["lora t given"]
        h = linear4bit.linear4bit_lora_silu_mul(x, g, u, lora_t=t)
        assert linear4bit_ws.LAUNCHES["lora t given"] == given + 1
        t_g = lora_t.LoraT(t.parts[:, :16], (a,), t.x_ptr)
        t_u = lora_t.LoraT(t.parts[:, 16:], (a2,), t.x_ptr)
        yg = linear4bit.linear4bit_lora_group(x, [g], lora_t=t_g)[0]
        yu = linear4bit.linear4bit_lora_group(x, [u], lora_t=t_u)[0]
        assert torch.equal(h, torch.nn.functional.silu(yg) * yu), f"M={m}"


@pytest.mark.gpu
@gpu
def test_pdl_launch_is_the_plain_launch_gpu():
    """Inside a decode step the kernel launches with PDL (counted by `pdl`): the single, split,
    grouped and gate/up launches give the plain launch's bits."""
    k = 2048
    p, g = [], []
    for n, out in ((1024, p), (8192, g)):  # 8192: a gate/up of one split
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda")
        x, a, b, _ = _inputs(8, n, k, 16, device="cuda")
        out.append(linear4bit.LinearPart(Packed4bit.from_quant_state(packed, qs), None, a, b,
                                         2.0))
    calls = [lambda: linear4bit.linear4bit_lora_group(x, p),
             lambda: linear4bit.linear4bit_lora_group(x, p * 3),
             lambda: [linear4bit.linear4bit_lora_silu_mul(x, g[0], g[0])]]
    plain = [[y.clone() for y in c()] for c in calls]
    before = pdl.LAUNCHES["linear4bit_ws_kernel"]
    with pdl.decode_step():
        if pdl.pdl_reason(x.device) is not None:
            pytest.skip(f"PDL off here: {pdl.pdl_reason(x.device)}")
        for c, ref in zip(calls, plain):
            for y, r in zip(c(), ref):
                assert torch.equal(y, r)
        torch.cuda.synchronize()
    assert pdl.LAUNCHES["linear4bit_ws_kernel"] == before + len(calls)
