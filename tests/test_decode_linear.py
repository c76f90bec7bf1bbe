"""trainers.sampling.kernels.linear4bit: the 4-bit + LoRA decode linear against bitsandbytes
dequantize + matmul + PEFT's LoRA and against the same sum in fp64.

CPU: the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET), on the real layer
shapes' N/K ratios at small K, a few real shapes marked `slow`; bitsandbytes quantizes on CPU.
GPU (`-m gpu`): every real Llama / Qwen2.5 / Mistral layer shape at 1B and 8B against the
modules' own CUDA forward, and a captured CUDA graph that sees in-place LoRA updates.

    python -m pytest -q tests/test_decode_linear.py            # CPU
    python -m pytest -q -m gpu tests/test_decode_linear.py     # H100

Tolerances (module docstring of linear4bit): u = 2⁻⁸ (bf16 unit roundoff), S = |x| @ |round(W)|ᵀ
+ |s| · (|x| @ |A|ᵀ) @ |B|ᵀ, K_eff = K + r + 4 the length of the fp32 sums (the r LoRA terms, bias,
the LoRA add, the split-K partials' adds):
    ours vs fp64 of the same bf16 operands:  u·|y| + 2·K_eff·2⁻²⁴·S   (one output rounding; fp32
                                             sums, the factor 2 covers (1+u) and |acc| ≤ |y|+γS)
    ours vs bitsandbytes + PEFT in bf16:     4u·|y| + (4u + 2·K_eff·2⁻²⁴)·S
The first is tight (a wrong nibble, scale or block index is off by ~|x||w|·√K ≫ K·2⁻²⁴·S); the
second is the contract "equal within bf16 rounding".
"""

import copy
import dataclasses
import itertools

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from bitsandbytes import functional as bnbF
from peft import LoraConfig
from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
from peft.tuners.lora.layer import Linear as LoraLinear

from trainers.sampling.kernels import arrivals, linear4bit, linear4bit_ws
from trainers.sampling.kernels._interp import interpreting
from trainers.sampling.kernels.linear4bit import (
    Packed4bit,
    UnsupportedLinear,
    decode_linear,
    linear4bit_lora,
    pick_config,
    unsupported_reason,
)

U = 2.0**-8
U32 = 2.0**-24
# with its pair table the warp-specialized kernel's weights are round(code) · scale (the scale
# applied to each chunk's fp32 MMA sum), not round(code · scale): |round(c)·s - round(c·s)| <=
# (2u + u²)|c·s| and |c·s| <= |round(c·s)| / (1 - u), so each weight is within S_U_PAIR · u of
# round(W)'s
S_U_PAIR = (2 + U) / (1 - U)

# (name, N, K, bias): every distinct projection shape of the model (q, k/v, o, gate/up, down)
REAL_SHAPES = {
    "llama-3.2-1b": [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)],
    "llama-3.1-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
    "mistral-7b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
    "qwen2.5-0.5b": [(896, 896), (128, 896), (4864, 896), (896, 4864)],
    "qwen2.5-1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)],
    "qwen2.5-7b": [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)],
}
# the same N/K ratios (1, 1/4, 4 and 1/4 with K = 4N for down, 1/7 for Qwen2.5-0.5B's k/v) at
# a K the interpreter runs in seconds; K a multiple of every blocksize tested
CPU_SHAPES = [(256, 256), (64, 256), (512, 128), (128, 512), (64, 448), (96, 192)]


def _quantize(n, k, *, quant_type, double, blocksize=64, device="cpu", seed=0):
    """A Params4bit-format weight of std 0.05, as bitsandbytes.functional.quantize_4bit packs it."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).to(device)
    return bnbF.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type,
                              compress_statistics=double)


def _inputs(m, n, k, r, *, seed=1, device="cpu", lora_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    a = (torch.randn(r, k, generator=g) / k**0.5).to(lora_dtype)
    b = (torch.randn(n, r, generator=g) * 0.1).to(lora_dtype)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return [t.to(device) for t in (x, a, b, bias)]


def _fp64(x, w_bf16, bias, a, b, s):
    """(y*, S): the sum in fp64 of the bf16 operands, and the absolute-value sum of the bound."""
    x, w = x.double(), w_bf16.double()
    y = x @ w.T
    big_s = x.abs() @ w.abs().T
    if bias is not None:
        y = y + bias.double()
    if a is not None:
        a, b = a.double(), b.double()
        y = y + s * (x @ a.T) @ b.T
        big_s = big_s + abs(s) * (x.abs() @ a.abs().T) @ b.abs().T
    return y, big_s


def _check(ours, y, big_s, *, k_eff, rel_u, s_u, what):
    err = (ours.double() - y).abs()
    tol = rel_u * U * y.abs() + (s_u * U + 2 * k_eff * U32) * big_s + 1e-30
    worst = (err / tol).argmax()
    i, j = divmod(worst.item(), err.shape[1])
    assert (err <= tol).all(), (
        f"{what}: worst [{i},{j}] ours={ours[i, j].item():.6g} ref={y[i, j].item():.6g} "
        f"err={err[i, j].item():.3g} > tol={tol[i, j].item():.3g}")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 256])
def test_weight_is_bitsandbytes_dequantized_exactly(quant_type, double, blocksize):
    """x = the identity: y = round(W)ᵀ exactly (one nonzero product per output, exact in fp32 and
    in bf16), so every dequantized weight equals bitsandbytes' `dequantize_4bit`, bit for bit."""
    n, k = 48, 256
    packed, qs = _quantize(n, k, quant_type=quant_type, double=double, blocksize=blocksize)
    eye = torch.eye(k, dtype=torch.bfloat16)  # M = 256 rows
    y = linear4bit_lora(eye, Packed4bit.from_quant_state(packed, qs))
    w_ref = bnbF.dequantize_4bit(packed, qs)  # (N, K) bf16
    assert w_ref.dtype == torch.bfloat16
    assert torch.equal(y, w_ref.T), (y.float() - w_ref.T.float()).abs().max()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_fp16_input_gets_fp16_rounded_weight(quant_type):
    """x in fp16: the weight is code · absmax rounded to fp16, as bitsandbytes dequantizes to
    fp16 (identity rows: exact)."""
    n, k = 32, 128
    packed, qs = _quantize(n, k, quant_type=quant_type, double=False)
    eye = torch.eye(k, dtype=torch.float16)
    y = linear4bit_lora(eye, Packed4bit.from_quant_state(packed, qs))
    w_ref = torch.ops.bitsandbytes.dequantize_4bit.default(
        packed, qs.absmax, qs.blocksize, qs.quant_type, qs.shape, torch.float16)
    assert y.dtype == torch.float16 and torch.equal(y, w_ref.T)


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False), ("nf4", False)])
@pytest.mark.parametrize("n,k", CPU_SHAPES)
# M = 1, 8 and 17 in the default suite; the other M (more programs to interpret) slow
@pytest.mark.parametrize("m", [1, 8, 17] + [pytest.param(m, marks=pytest.mark.slow)
                                             for m in (3, 64, 255)])
def test_matches_fp64(quant_type, double, n, k, m):
    """Odd M (one row, a partial 16-row tile, several 64-row tiles) × the layers' N/K ratios;
    LoRA r = 16, s = α/r = 2, bias."""
    packed, qs = _quantize(n, k, quant_type=quant_type, double=double)
    x, a, b, bias = _inputs(m, n, k, 16)
    w = Packed4bit.from_quant_state(packed, qs)
    ours = linear4bit_lora(x, w, bias=bias, lora_a=a, lora_b=b, scaling=2.0)
    y, big_s = _fp64(x, bnbF.dequantize_4bit(packed, qs), bias, a, b, 2.0)
    _check(ours, y, big_s, k_eff=k + 16 + 4, rel_u=1, s_u=0, what=f"M={m} N={n} K={k}")


@pytest.mark.parametrize("split_k,block_n,block_m,prefetch", [
    (1, 32, 16, False), (2, 64, 16, True),
    pytest.param(3, 16, 32, True, marks=pytest.mark.slow), (8, 64, 64, False),
    (30, 64, 16, True)])
@pytest.mark.parametrize("lora,lora_dtype", [(False, None), (True, torch.bfloat16),
                                             (True, torch.float32)])
def test_tile_configs_and_split_k(split_k, block_n, block_m, prefetch, lora, lora_dtype):
    """Every tiling computes the same sum: split-K (an uneven last split, and more splits than
    absmax blocks), BLOCK_N not dividing N, the loads one block ahead or not; each split
    carries its own share of the LoRA term, in 16-bit and in fp32 factors."""
    n, k, m = 80, 384, 5
    packed, qs = _quantize(n, k, quant_type="nf4", double=True)
    x, a, b, bias = _inputs(m, n, k, 8, lora_dtype=lora_dtype or torch.bfloat16)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split_k, "PREFETCH": prefetch}
    kw = {"lora_a": a, "lora_b": b, "scaling": 0.5} if lora else {}
    ours = linear4bit_lora(x, Packed4bit.from_quant_state(packed, qs), bias=bias, config=cfg, **kw)
    y, big_s = _fp64(x, bnbF.dequantize_4bit(packed, qs), bias, *((a, b) if lora else (None,
                     None)), 0.5)
    _check(ours, y, big_s, k_eff=k + 8 + split_k + 4, rel_u=1, s_u=0, what=f"config {cfg}")
    if split_k > 1:  # the last split's in-kernel reduction: the second launch's bits
        two = linear4bit_lora(x, Packed4bit.from_quant_state(packed, qs), bias=bias,
                              config={**cfg, "LAST_REDUCES": False}, **kw)
        assert torch.equal(ours, two)
        assert not arrivals.COUNTERS[x.device].any(), "tile counters left nonzero"


def _lora_module(n, k, *, quant_type="nf4", double=True, bias=True, r=16, alpha=32,
                 dropout=0.05, lora_dtype=torch.bfloat16, seed=0, device="cpu"):
    """PEFT lora.Linear4bit over a bitsandbytes Linear4bit (bf16 compute), B nonzero, eval;
    bitsandbytes quantizes the weight when it reaches `device`."""
    base = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=torch.bfloat16, quant_type=quant_type)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    base.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type=quant_type,
                                    compress_statistics=double)
    if bias:
        base.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16))
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout)
    mod = LoraLinear4bit(base, "default", cfg, r=r, lora_alpha=alpha)
    mod.lora_A["default"].to(lora_dtype)
    mod.lora_B["default"].to(lora_dtype)
    with torch.no_grad():
        mod.lora_B["default"].weight.copy_(torch.randn(n, r, generator=g) * 0.1)
    return mod.to(device).eval()


def _module_bound_check(ours, mod, x, ref, what):
    """ours vs the module's own forward `ref`, within the bf16 contract."""
    base = mod.get_base_layer()
    qs = base.weight.quant_state
    w_bf16 = bnbF.dequantize_4bit(base.weight.data, qs)
    a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
    s = mod.scaling["default"]
    _, big_s = _fp64(x, w_bf16, base.bias, a, b, s)
    k = x.shape[1]
    _check(ours, ref.double(), big_s, k_eff=k + a.shape[0] + 4, rel_u=4, s_u=4, what=what)


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", True), ("nf4", False)])
@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 8, 17])
def test_module_matches_bitsandbytes_and_peft(quant_type, double, lora_dtype, m):
    """decode_linear(x, lora.Linear4bit) against the module's forward (bitsandbytes' dequantize +
    bf16 matmul, PEFT's LoRA with its casts; dropout in eval mode), and bit for bit the kernel
    (so the fused path is what ran). fp32 LoRA factors: what prepare_model_for_kbit_training
    leaves."""
    n, k = 96, 256
    mod = _lora_module(n, k, quant_type=quant_type, double=double, lora_dtype=lora_dtype)
    x = _inputs(m, n, k, 16)[0]
    assert unsupported_reason(mod) is None
    ours = decode_linear(x, mod)
    base = mod.get_base_layer()
    direct = linear4bit_lora(x, Packed4bit.from_quant_state(base.weight.data,
                                                            base.weight.quant_state),
                             bias=base.bias, lora_a=mod.lora_A["default"].weight,
                             lora_b=mod.lora_B["default"].weight, scaling=mod.scaling["default"])
    assert torch.equal(ours, direct)
    # bitsandbytes' CPU forward may repack the weight in place (AVX512): reference on a copy
    with torch.no_grad():
        ref = copy.deepcopy(mod)(x)
    assert ours.dtype == ref.dtype == torch.bfloat16
    _module_bound_check(ours, mod, x, ref, f"{quant_type} double={double} {lora_dtype} M={m}")


GROUP_CONFIGS = [(1, 32, True, True), (3, 64, True, True), (4, 16, False, True),
                 (2, 64, True, False), (2, 128, True, True)]
# the CPU cases: the configs with the most programs for the interpreter to run are slow
CPU_GROUP_CONFIGS = [pytest.param(*c, marks=pytest.mark.slow)
                     if c in ((1, 32, True, True), (4, 16, False, True)) else c
                     for c in GROUP_CONFIGS]


@pytest.mark.parametrize("segs", [2, 3])
@pytest.mark.parametrize("split_k,block_n,prefetch,last", CPU_GROUP_CONFIGS)
def test_grouped_launch_is_each_projection_alone(segs, split_k, block_n, prefetch, last,
                                                 device="cpu"):
    """One launch of 2 or 3 projections of the same x (q/k/v, gate/up): each output equals the
    projection computed alone with the same tiles, bit for bit, with N_s not multiples of
    BLOCK_N (a segment's last tile is partial, and the next segment's first tile starts at its
    own row 0; with BLOCK_N 128 the second segment starts at tile 1), different scalings and
    biases, split K reduced in the launch or by the second launch."""
    from trainers.sampling.kernels.linear4bit import LinearPart, linear4bit_lora_group

    k, m = 512, 5  # 8 absmax blocks, 2 register-tile steps: split K either way
    parts = []
    for i, n in enumerate((96, 40, 72)[:segs]):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, seed=10 + i, device=device)
        _, a, b, bias = _inputs(m, n, k, 8, seed=20 + i, device=device)
        parts.append(LinearPart(Packed4bit.from_quant_state(packed, qs), bias, a, b, 0.5 + i))
    x = _inputs(m, 8, k, 8, seed=3, device=device)[0]
    cfg = {"BLOCK_M": 16, "BLOCK_N": block_n, "SPLIT_K": split_k, "PREFETCH": prefetch,
           "LAST_REDUCES": last}
    ys = linear4bit_lora_group(x, parts, config=cfg)
    assert len(ys) == segs
    for i, (y, p) in enumerate(zip(ys, parts)):
        alone = linear4bit_lora(x, p.weight, bias=p.bias, lora_a=p.lora_a, lora_b=p.lora_b,
                                scaling=p.scaling, config=cfg)
        assert y.shape == alone.shape and torch.equal(y, alone), f"segment {i}"
    if split_k > 1 and last:
        assert not arrivals.COUNTERS[x.device].any(), "tile counters left nonzero"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_k,block_n,prefetch,last", GROUP_CONFIGS)
def test_grouped_launch_gpu(split_k, block_n, prefetch, last):
    """The same on the GPU, compiled (the code looked up by byte permutes; the compiler
    specializes a segment boundary of 1 tile as a constant)."""
    test_grouped_launch_is_each_projection_alone(3, split_k, block_n, prefetch, last, "cuda")


def _silu_mul_outputs(g, u):
    """The values round(silu(g) · u) may take for bf16 g, u when silu's fp32 exp is any within
    2 ulps (libdevice's on the GPU, numpy's in the interpreter): s = g / (1 + exp(−g)) in fp32
    is within 1.5 · 2⁻²² relative of the exact (exp 2 · 2⁻²³, the add and the division 2⁻²⁴
    each), so round(s) to bf16 lies between the roundings of s·(1 ∓ 2⁻²¹) (rounding is
    monotone); the product of two bf16 values is exact in fp32 and rounded once.
    Returns (low, high) outputs, equal where no rounding boundary lies within reach."""
    s64 = g.double() / (1 + torch.exp(-g.double()))
    reach = s64.abs() * 2.0**-21
    outs = [((s64 + d).float().bfloat16().float() * u.float()).bfloat16()
            for d in (-reach, reach)]
    return outs[0], outs[1]


@pytest.mark.parametrize("split_k,block_n,prefetch,last", CPU_GROUP_CONFIGS)
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_launch_is_torchs_silu_mul(split_k, block_n, prefetch, last, bias,
                                            device="cpu", block_m=16):
    """silu(gate) · up from the gate/up launch against torch's `F.silu(gate) * up` on the
    grouped launch's two outputs (the same tiles): bit for bit on the GPU and where the second
    launch reduces; in the interpreter each value is one `_silu_mul_outputs` allows, and most
    are unambiguous. N = 96 (a partial last tile), K split or not, tile counters reset."""
    from trainers.sampling.kernels.linear4bit import (
        LinearPart,
        linear4bit_lora_group,
        linear4bit_lora_silu_mul,
    )

    k, m, n = 256, 5, 96
    parts = []
    for i in range(2):
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, seed=30 + i, device=device)
        _, a, b, bias_i = _inputs(m, n, k, 8, seed=40 + i, device=device)
        parts.append(LinearPart(Packed4bit.from_quant_state(packed, qs),
                                bias_i if bias else None, a, b, 0.5 + i))
    x = _inputs(m, 8, k, 8, seed=4, device=device)[0]
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split_k, "PREFETCH": prefetch,
           "LAST_REDUCES": last}
    h = linear4bit_lora_silu_mul(x, *parts, config=cfg)
    g, u = linear4bit_lora_group(x, parts, config=cfg)
    assert h.shape == (m, n) and h.dtype == x.dtype
    assert g.abs().max() > 2 and (g < -1).any(), "gate values where silu is far from linear"
    if device == "cuda" or not last:
        assert torch.equal(h, torch.nn.functional.silu(g) * u)
    else:
        low, high = _silu_mul_outputs(g.cpu(), u.cpu())
        assert ((h == low) | (h == high)).all(), (h - low).abs().max()
        assert (low != high).float().mean() < 0.02
    if last:
        assert not arrivals.COUNTERS[x.device].any(), "tile counters left nonzero"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_k,block_n,prefetch,last", GROUP_CONFIGS)
def test_silu_mul_launch_gpu(split_k, block_n, prefetch, last):
    """The same on the GPU, compiled: bit for bit torch's silu · mul (libdevice's expf)."""
    test_silu_mul_launch_is_torchs_silu_mul(split_k, block_n, prefetch, last, True, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_k", [1, 2])
def test_silu_mul_launch_gpu_64_row_tiles(split_k):
    """The tiles `pick_config` gives a gate/up launch of more than 16 rows (BLOCK_M 64,
    BLOCK_N 128, one or two splits): the same bits."""
    test_silu_mul_launch_is_torchs_silu_mul(split_k, 128, True, True, True, "cuda", block_m=64)


def test_silu_mul_modules():
    """decode_silu_mul(x, gate, up) of PEFT 4-bit LoRA modules is torch's silu · mul of
    decode_linears' two outputs (within `_silu_mul_outputs`); a gate and up of different
    out_features are refused with the reason."""
    from trainers.sampling.kernels.linear4bit import (
        decode_linears,
        decode_silu_mul,
        silu_mul_modules_reason,
    )

    k = 256
    gate, up = (_lora_module(160, k, seed=7 + i) for i in range(2))
    x = _inputs(8, 128, k, 16)[0][:, None] * 4  # (B, 1, K), gate values past ±2
    assert silu_mul_modules_reason(gate, up, x.dtype) is None
    h = decode_silu_mul(x, gate, up)
    g, u = decode_linears(x, [gate, up])
    assert h.shape == g.shape == (8, 1, 160) and h.dtype == x.dtype
    low, high = _silu_mul_outputs(g, u)
    assert ((h == low) | (h == high)).all()
    other = _lora_module(96, k)
    assert "output features" in silu_mul_modules_reason(gate, other, x.dtype)
    with pytest.raises(UnsupportedLinear, match="output features"):
        decode_silu_mul(x, gate, other)


def test_grouped_modules_match_their_forward():
    """decode_linears(x, [q, k, v]) of PEFT 4-bit LoRA modules: each output within the bf16
    contract of the module's own forward; projections that cannot share a launch (another
    in_features, one without LoRA) are refused with the reason, never computed wrongly."""
    from trainers.sampling.kernels.linear4bit import decode_linears, group_modules_reason

    k = 256
    mods = [_lora_module(n, k, seed=i) for i, n in enumerate((128, 32, 32))]
    x = _inputs(8, 128, k, 16)[0][:, None]  # (B, 1, K): the decode step's shape
    assert group_modules_reason(mods, x.dtype) is None
    ys = decode_linears(x, mods)
    for mod, y in zip(mods, ys):
        with torch.no_grad():
            ref = copy.deepcopy(mod)(x)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        _module_bound_check(y[:, 0], mod, x[:, 0], ref[:, 0], "grouped")
    other_k = _lora_module(32, 128)
    assert "in_features" in group_modules_reason([mods[0], other_k], x.dtype)
    no_lora = _lora_module(32, k, seed=5).get_base_layer()  # bitsandbytes' layer alone
    assert "LoRA" in group_modules_reason([mods[0], no_lora], x.dtype)
    with pytest.raises(UnsupportedLinear, match="LoRA"):
        decode_linears(x, [mods[0], no_lora])
    assert "1 to 3" in group_modules_reason(mods + mods[:1], x.dtype)


def test_lora_factors_are_read_live():
    """An in-place optimizer-style update of A and B changes the next call's output to the new
    values' result (nothing cached between calls)."""
    mod = _lora_module(64, 128)
    x = _inputs(4, 64, 128, 16)[0]
    before = decode_linear(x, mod)
    with torch.no_grad():
        mod.lora_A["default"].weight.mul_(-2.0)
        mod.lora_B["default"].weight.add_(0.3)
    after = decode_linear(x, mod)
    assert not torch.equal(before, after)
    with torch.no_grad():
        ref = copy.deepcopy(mod)(x)
    _module_bound_check(after, mod, x, ref, "after the update")


def test_plain_linear4bit_and_3d_input():
    """A bare bitsandbytes Linear4bit (no LoRA), x (B, T, K)."""
    mod = _lora_module(64, 128).get_base_layer()
    x = _inputs(6, 64, 128, 16)[0].reshape(2, 3, 128)
    ours = decode_linear(x, mod)
    w_bf16 = bnbF.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
    y, big_s = _fp64(x.reshape(6, 128), w_bf16, mod.bias, None, None, 0.0)
    assert ours.shape == (2, 3, 64)
    _check(ours.reshape(6, 64), y, big_s, k_eff=128 + 4, rel_u=1, s_u=0, what="plain")


def test_dense_linear_with_lora_is_peft():
    """bf16 nn.Linear + PEFT lora.Linear: the plain-GEMM path in PEFT's order, bit for bit."""
    torch.manual_seed(0)
    base = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    mod = LoraLinear(base, "default", LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1), r=8,
                     lora_alpha=16)
    mod.lora_B["default"].weight.data.normal_(0, 0.1)
    mod.eval()
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(decode_linear(x, mod), mod(x))


def test_unsupported_modules_say_why():
    mod = _lora_module(64, 128, dropout=0.1).train()
    assert "dropout p=0.1 in train mode" in unsupported_reason(mod)
    with pytest.raises(UnsupportedLinear, match="dropout"):
        decode_linear(_inputs(2, 64, 128, 16)[0], mod)
    mod.eval()
    assert unsupported_reason(mod) is None
    mod.update_layer("second", 4, lora_alpha=8, config=LoraConfig(r=4, lora_alpha=8))
    mod.set_adapter(["default", "second"])
    assert "2 active adapters" in unsupported_reason(mod)
    assert "Conv2d" in unsupported_reason(torch.nn.Conv2d(3, 3, 1))
    dora = LoraLinear(torch.nn.Linear(32, 16), "default",
                      LoraConfig(r=4, lora_alpha=8, use_dora=True), r=4, lora_alpha=8,
                      use_dora=True)
    assert "variant" in unsupported_reason(dora)


@pytest.mark.parametrize("kind", ["bf16", pytest.param("f16", marks=pytest.mark.slow)])
def test_prmt_assembly_looks_up_every_code(kind):
    """The GPU's code lookup, its PTX run by a reference interpreter of the instructions it uses
    (tests/_ptx_emu.py): the table of round(code[i] · scale) as byte planes, then the two
    nibbles of every byte value 0-255, in each of the word's four byte slots, give exactly
    round(code · scale), for the NF4 and FP4 codes and random ones, at random scales; the
    outputs pair bytes 0-1 and 2-3, the lower byte's value in the lower half."""
    import numpy as np
    from _ptx_emu import f32_bits, half_bits, run

    rng = np.random.default_rng(0)
    codes = [bnbF.get_4bit_type("nf4", device="cpu").float().numpy(),
             bnbF.get_4bit_type("fp4", device="cpu").float().numpy(),
             rng.uniform(-3, 3, 16).astype(np.float32)]
    table_asm = linear4bit._table_asm(f"cvt.rn.{kind}x2.f32")
    for code, scale in itertools.product(codes, rng.uniform(1e-3, 8, 3).astype(np.float32)):
        planes = run(table_asm, [0] * 8 + [f32_bits(scale)] + [f32_bits(c) for c in code])[:8]
        want = [half_bits(np.float32(c) * scale, kind) for c in code]
        for b0 in range(256):
            bs = [b0, *(int(v) for v in rng.integers(256, size=3))]
            for r in range(4):  # the byte value b0 in every slot
                perm = bs[r:] + bs[:r]
                word = perm[0] | perm[1] << 8 | perm[2] << 16 | perm[3] << 24
                out = run(linear4bit._DEQUANT_ASM, [0, 0, 0, 0, word] + planes)
                got_hi = [out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16]
                got_lo = [out[2] & 0xFFFF, out[2] >> 16, out[3] & 0xFFFF, out[3] >> 16]
                assert got_hi == [want[b >> 4] for b in perm], (kind, scale, perm)
                assert got_lo == [want[b & 15] for b in perm], (kind, scale, perm)


def test_pairs_assembly_pairs_each_bytes_nibbles():
    """The register tile's lookup (`_dequant_asm(pairs=True)`), run by the PTX interpreter:
    output i holds byte i's two values, the high nibble's (the even element) in the lower half,
    for every byte value in every slot of the word."""
    import numpy as np
    from _ptx_emu import f32_bits, half_bits, run

    rng = np.random.default_rng(1)
    code = bnbF.get_4bit_type("nf4", device="cpu").float().numpy()
    scale = np.float32(0.37)
    planes = run(linear4bit._table_asm("cvt.rn.bf16x2.f32"),
                 [0] * 8 + [f32_bits(scale)] + [f32_bits(c) for c in code])[:8]
    want = [half_bits(np.float32(c) * scale, "bf16") for c in code]
    for b0 in range(256):
        bs = [b0, *(int(v) for v in rng.integers(256, size=3))]
        for r in range(4):
            perm = bs[r:] + bs[:r]
            word = perm[0] | perm[1] << 8 | perm[2] << 16 | perm[3] << 24
            out = run(linear4bit._PAIRS_ASM, [0, 0, 0, 0, word] + planes)
            assert [[o & 0xFFFF, o >> 16] for o in out[:4]] == \
                [[want[b >> 4], want[b & 15]] for b in perm], perm


def test_register_tile_is_chosen_where_it_runs():
    """pick_config takes the register tile up to 16 rows at blocksizes that are multiples of
    64, and the block-a-step tiles otherwise; REG_TILE=True where it cannot run names why."""
    assert pick_config(8, 4096, 4096, 64, 132)["REG_TILE"]
    assert pick_config(16, [4096, 1024, 1024], 4096, 128, 132)["REG_TILE"]
    assert "REG_TILE" not in pick_config(17, 4096, 4096, 64, 132)
    assert "REG_TILE" not in pick_config(8, 4096, 4096, 32, 132)
    assert "REG_TILE" not in pick_config(8, 4096, 4096, 64, 132, reg_tile=False)
    packed, qs = _quantize(32, 256, quant_type="nf4", double=False)
    x = _inputs(4, 32, 256, 8)[0]
    with pytest.raises(ValueError, match="REG_TILE=True.*BLOCK_N=32"):
        linear4bit_lora(x, Packed4bit.from_quant_state(packed, qs),
                        config={"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": 1, "REG_TILE": True})
    packed, qs = _quantize(32, 256, quant_type="nf4", double=False, blocksize=32)
    with pytest.raises(ValueError, match="REG_TILE=True.*blocksize 32"):
        linear4bit_lora(x, Packed4bit.from_quant_state(packed, qs),
                        config={"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "REG_TILE": True})


@pytest.mark.parametrize("k,split_k,blocksize", [
    (448, 1, 64), (448, 2, 64), pytest.param(1280, 3, 64, marks=pytest.mark.slow),
    (1280, 3, 128), (128, 1, 64), (128, 1, 128)])
def test_register_tile_against_block_steps(k, split_k, blocksize):
    """The register tile and the block-a-step loop compute the same sum in different orders:
    both within the fp64 bound, K not a multiple of 256 (a masked last step), uneven splits,
    N not a multiple of 64, with LoRA and a bias."""
    n, m = 80, 7
    packed, qs = _quantize(n, k, quant_type="nf4", double=True, blocksize=blocksize)
    x, a, b, bias = _inputs(m, n, k, 16)
    w = Packed4bit.from_quant_state(packed, qs)
    y, big_s = _fp64(x, bnbF.dequantize_4bit(packed, qs), bias, a, b, 2.0)
    for reg_tile in (True, False):
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": split_k, "REG_TILE": reg_tile}
        ours = linear4bit_lora(x, w, bias=bias, lora_a=a, lora_b=b, scaling=2.0, config=cfg)
        _check(ours, y, big_s, k_eff=k + 16 + split_k + 4, rel_u=1, s_u=0, what=f"{cfg}")


def test_bad_inputs_name_the_argument():
    packed, qs = _quantize(32, 128, quant_type="nf4", double=False)
    w = Packed4bit.from_quant_state(packed, qs)
    with pytest.raises(ValueError, match=r"x has shape \(2, 64\)"):
        linear4bit_lora(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="x has dtype torch.float32"):
        linear4bit_lora(torch.zeros(2, 128), w)
    with pytest.raises(ValueError, match="lora_a"):
        linear4bit_lora(torch.zeros(2, 128, dtype=torch.bfloat16), w,
                        lora_a=torch.zeros(4, 64), lora_b=torch.zeros(32, 4))
    _, qs_odd = _quantize(32, 96, quant_type="nf4", double=False, blocksize=64)
    with pytest.raises(ValueError, match="K=96 is not a multiple of blocksize=64"):
        Packed4bit.from_quant_state(packed, qs_odd)
    if interpreting():
        with pytest.raises(ValueError, match="config PRMT=True"):
            linear4bit_lora(torch.zeros(2, 128, dtype=torch.bfloat16), w,
                            config={"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "PRMT": True})


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The interpreter runs Python, not the compiler: compile every kernel variant for sm_90 on
    the CPU (Triton's front end and ptxas) in a subprocess with the interpreter off."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"no ptxas at {ptxas}")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(root / "tests" / "_compile_decode_kernels.py")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0 and "all compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("n,k", [(128, 896), (896, 896), (512, 2048)])
def test_real_small_shapes_cpu(n, k):
    """Real k/v and q shapes of Qwen2.5-0.5B and Llama-3.2-1B in the interpreter."""
    packed, qs = _quantize(n, k, quant_type="nf4", double=True)
    x, a, b, bias = _inputs(8, n, k, 16)
    ours = linear4bit_lora(x, Packed4bit.from_quant_state(packed, qs), bias=bias, lora_a=a,
                           lora_b=b, scaling=2.0)
    y, big_s = _fp64(x, bnbF.dequantize_4bit(packed, qs), bias, a, b, 2.0)
    _check(ours, y, big_s, k_eff=k + 20, rel_u=1, s_u=0, what=f"N={n} K={k}")


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(REAL_SHAPES))
@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", True), ("nf4", False)])
def test_real_shapes_gpu(model, quant_type, double):
    """Every real projection shape, M in {1, 3, 8, 64, 255}, against the modules' CUDA forward
    (bitsandbytes' gemv_4bit at M = 1, dequantize + cuBLAS above) and against fp64; Qwen's
    projections with a bias, the others without, as in the models."""
    bias = model.startswith("qwen")
    for n, k in REAL_SHAPES[model]:
        mod = _lora_module(n, k, quant_type=quant_type, double=double, bias=bias,
                           device="cuda")
        base = mod.get_base_layer()
        w_bf16 = bnbF.dequantize_4bit(base.weight.data, base.weight.quant_state)
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        for m in (1, 3, 8, 64, 255):
            x = _inputs(m, n, k, 16, device="cuda")[0]
            pairs_before = linear4bit_ws.LOOKUPS["pair table"]
            ours = decode_linear(x, mod)
            pair = linear4bit_ws.LOOKUPS["pair table"] > pairs_before  # weights within P·u
            with torch.no_grad():
                ref = mod(x)
            y, big_s = _fp64(x, w_bf16, base.bias, a, b, mod.scaling["default"])
            what = f"{model} N={n} K={k} M={m} {quant_type} double={double} pair={pair}"
            extra = S_U_PAIR if pair else 0
            _check(ours, y, big_s, k_eff=k + 20, rel_u=1, s_u=extra, what=what + " vs fp64")
            _check(ours, ref.double(), big_s, k_eff=k + 20, rel_u=4, s_u=4 + extra,
                   what=what + " vs bnb")


@pytest.mark.gpu
@pytest.mark.parametrize("prmt", [True, False])
def test_weight_exact_gpu(prmt):
    """Identity rows: every dequantized weight equals bitsandbytes' `dequantize_4bit` bit for
    bit, in bf16 and fp16, at every blocksize, with the code looked up by register byte
    permutes (PRMT, the GPU default) and by memory gathers."""
    for quant_type, double, bs in itertools.product(("nf4", "fp4"), (False, True),
                                                    (32, 64, 128, 256)):
        packed, qs = _quantize(64, 512, quant_type=quant_type, double=double, blocksize=bs,
                               device="cuda")
        w = Packed4bit.from_quant_state(packed, qs)
        for dt in (torch.bfloat16, torch.float16):
            qs_dt = copy.copy(qs)
            qs_dt.dtype = dt
            ref = bnbF.dequantize_4bit(packed, qs_dt)
            assert ref.dtype == dt
            for m in (512, 8):  # every weight (BLOCK_M 64), and a decode batch's tile (16)
                eye = torch.eye(512, dtype=dt, device="cuda")[:m]
                cfg = {**pick_config(m, 64, 512, bs, torch.cuda.get_device_properties(
                    0).multi_processor_count), "PRMT": prmt}
                y = linear4bit_lora(eye, w, config=cfg)
                assert torch.equal(y, ref.T[:m]), (quant_type, double, bs, dt, m)


@pytest.mark.gpu
def test_code_lookups_agree_gpu():
    """The two code lookups build the same bf16 weight tiles, so the same kernel gives the same
    output bit for bit, with the loads one block ahead or not, the split-K sum in the kernel's
    last split or in a second launch, on real layer shapes with LoRA and split K."""
    for n, k in REAL_SHAPES["llama-3.2-1b"]:
        packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda")
        w = Packed4bit.from_quant_state(packed, qs)
        for m in (1, 8, 64):
            x, a, b, bias = _inputs(m, n, k, 16, device="cuda")
            cfg = pick_config(m, n, k, 64, torch.cuda.get_device_properties(0)
                              .multi_processor_count)
            ys = [linear4bit_lora(x, w, bias=bias, lora_a=a, lora_b=b, scaling=2.0,
                                  config={**cfg, "PRMT": prmt, "PREFETCH": pf,
                                          "LAST_REDUCES": lr})
                  for prmt, pf, lr in ((True, True, True), (True, False, True),
                                       (False, False, True), (True, True, False))]
            assert all(torch.equal(ys[0], y) for y in ys[1:]), (n, k, m)
            assert not arrivals.COUNTERS[x.device].any()


@pytest.mark.gpu
def test_unaligned_packed_weight_gpu():
    """A packed weight that is a view at a 2-byte offset cannot be read as 32-bit words: the
    launch takes the memory gathers (in the register tile at 8 rows, the block-a-step loop at
    64) and gives the aligned weight's output bit for bit. The warp-specialized kernel is off
    here: it would take the aligned weight at 8 rows (its own order of the fp32 sums), and
    its unaligned case is `linear4bit_ws.reason`'s."""
    from trainers.sampling.kernels import linear4bit_ws

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(linear4bit_ws.ENV, "0")
        _unaligned_packed_weight_matches()


def _unaligned_packed_weight_matches():
    n, k = 2048, 2048
    packed, qs = _quantize(n, k, quant_type="nf4", double=True, device="cuda")
    w = Packed4bit.from_quant_state(packed, qs)
    storage = torch.empty(packed.numel() + 2, dtype=torch.uint8, device="cuda")
    storage[2:].copy_(packed.reshape(-1))
    shifted = dataclasses.replace(w, packed=storage[2:])
    assert shifted.packed.data_ptr() % 4 == 2
    for m in (8, 64):
        x, a, b, bias = _inputs(m, n, k, 16, device="cuda")
        ys = [linear4bit_lora(x, ww, bias=bias, lora_a=a, lora_b=b, scaling=2.0)
              for ww in (w, shifted)]
        assert torch.equal(ys[0], ys[1]), m


@pytest.mark.gpu
def test_cuda_graph_sees_lora_updates():
    """Captured once; A and B updated in place (as an optimizer step does); the replay equals a
    fresh eager call with the new values, bit for bit (the same kernels on the same inputs)."""
    mod = _lora_module(2048, 2048, double=True, bias=False, device="cuda")
    x = _inputs(8, 2048, 2048, 16, device="cuda")[0]
    decode_linear(x, mod)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = decode_linear(x, mod)
    with torch.no_grad():
        mod.lora_A["default"].weight.mul_(-1.5)
        mod.lora_B["default"].weight.add_(0.05)
    graph.replay()
    eager = decode_linear(x, mod)
    assert torch.equal(y_graph, eager)
