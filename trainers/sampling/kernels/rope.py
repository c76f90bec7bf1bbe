"""RoPE with the KV-cache write for one decode token per row, in transformers' semantics.

q (B, Hq, D), k and v (B, Hkv, D) (the q/k/v projections' outputs, viewed per head; Hq = G·Hkv),
cos and sin (B, D) as the model's `rotary_emb` returns them for each row's position (any rope
type: default, linear, llama3, dynamic, yarn scale the inverse frequencies or cos / sin before
they get here; or, with `tables`, (P, D) over positions 0 .. P - 1, row b's at its slot), the
layer's cache K, V (B, Hkv, M, D) and slots (B,):

    y      = x                                     (Llama, Qwen2, Mistral)
    y      = round_Y(w · round_x(x · (mean_d x² + ε)^(-1/2)))   (Qwen3's q_norm / k_norm over D)
    rope(y) = round(round(y · cos) + round(rotate_half(y) · sin)),  rotate_half(y) = (-y₂, y₁)
    K[b, :, slots_b] = round_cache(rope(y_k)),  V[b, :, slots_b] = round_cache(v)
    returns rope(y_q)

with y₁, y₂ the two halves of the head dim, round_t rounding to nearest even in dtype t, Y the
promoted dtype of the norm weight and x, and `round` to the promoted dtype of y and cos (the
output's dtype). This is transformers' `apply_rotary_pos_emb` (and Qwen3RMSNorm before it) and the
decode loop's index_put of k and v: one program per (row, kv head) reads its G query heads, its
key and value head and the row's cos / sin once, writes q's G rotated heads and one slot of K and
V. Memory: q, k, v, cos, sin read once, q written once, B·Hkv·D elements of K and of V written.

Exactness. Each torch op above is one fp32 operation on exactly converted inputs and one rounding
to its output dtype (torch's elementwise ops compute 16-bit types in fp32): a product of two
16-bit floats is exact in fp32, so round(y · cos) is one rounding of the exact product, and the
sum of the two rounded terms is the fp32 sum rounded once, as torch's bf16 add does. The kernel
performs the same operations in the same order with fp contraction off (no FMA may merge a
product into the sum), so without the norm its outputs equal transformers' bit for bit, in bf16,
fp16 and fp32. With Qwen3's norm the mean of x² and the inverse square root differ from torch's
by the fp32 summation order and the rsqrt's few fp32 ulps (relative δ = (D + 8)·2⁻²⁴ at most),
which can move round_x(x · r) across a rounding boundary: that element of n is then one ulp of
x's dtype off (bf16: ≤ 2⁻⁷ relative), as `rmsnorm.add_rmsnorm` states, and the rotation carries
it. With u_x, u_Y, u the unit roundoffs of x's dtype, Y and the output dtype (2⁻⁸ for bf16, 2⁻²⁴
for fp32), ε_n = (2u_x + δ + 2·2⁻²⁴)(1 + u_x), ε_y = (ε_n + u_Y(2 + ε_n))(1 + 2u_Y) bounds
|y' − y| / |y|, and with T_i = |y_i cos_i| + |y_j sin_i| (j the partner element of i),

    |rope(y')_i − rope(y)_i| ≤ (ε_y + 4u)(1 + ε_y)(1 + u) · T_i

(ε_y from y, u(2 + ε_y) from the two products rounded on each side, u(1 + u)(2 + ε_y) from the
two sums); in bf16 that is about 2⁻⁵ · T_i. Elements whose y matches are bit for bit.

Preconditions the launcher cannot check without a device sync: 0 ≤ slots_b < M (the decode loop
sizes the cache so). A slot outside [0, M) is not written (memory outside the cache is never
touched).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels._interp import interpreting, to_dtype
from .pdl import grid_wait, launch_args
from .rmsnorm import rmsnorm_params
from .split_sum import CONSUMED, SplitSum, kernel_args, load_sum

# a program's warps: its loads (each of q's G heads, k and v, and a SplitSum's partials of
# each) spread over 128 threads rather than queued in a few
NUM_WARPS = 4
# the kernel's X_DT for each dtype q, k and v may hold
ROPE_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(v, dtype: tl.constexpr, INTERP: tl.constexpr):
    """v (fp32) rounded to `dtype` (nearest even) and back to fp32: one torch op's output."""
    return to_dtype(v, dtype, INTERP).to(tl.float32)


@triton.jit
def _norm_rope(x1, x2, w_ptr, c1, c2, s1, s2, offs, mask, eps, D,
               X_DT: tl.constexpr, OUT_DT: tl.constexpr, NORM: tl.constexpr,
               INTERP: tl.constexpr):
    """(rope(y)₁, rope(y)₂) for the halves x1, x2 (R, BLOCK_HALF) fp32 of R heads, cos / sin
    halves (1, BLOCK_HALF); y = the Qwen3 norm of x (NORM) or x. Each line is one torch op."""
    if NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D  # masked lanes are 0
        r = tl.rsqrt(var + eps)[:, None]
        n1 = _round(x1 * r, X_DT, INTERP)  # hidden_states.to(input_dtype)
        n2 = _round(x2 * r, X_DT, INTERP)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0)
        w2 = tl.load(w_ptr + D // 2 + offs, mask=mask, other=0.0)
        Y_DT: tl.constexpr = tl.float32 if w_ptr.dtype.element_ty == tl.float32 else X_DT
        x1 = _round(w1.to(tl.float32)[None, :] * n1, Y_DT, INTERP)  # weight * (...)
        x2 = _round(w2.to(tl.float32)[None, :] * n2, Y_DT, INTERP)
    # q·cos + rotate_half(q)·sin with rotate_half(q) = (-q₂, q₁); round(-a) = -round(a), and
    # a + (-b) = a - b exactly, so the first half is round(round(q₁c₁) - round(q₂s₁))
    o1 = _round(_round(x1 * c1, OUT_DT, INTERP) - _round(x2 * s1, OUT_DT, INTERP), OUT_DT, INTERP)
    o2 = _round(_round(x2 * c2, OUT_DT, INTERP) + _round(x1 * s2, OUT_DT, INTERP), OUT_DT, INTERP)
    return o1, o2


@triton.jit
def rope_rows(x_ptr, heads, head_ok, stride_h, stride_s, bias_ptr, cos_ptr, sin_ptr, stride_c,
              cs_row, cs_ok, D: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
              X_DT: tl.constexpr, OUT_DT: tl.constexpr, INTERP: tl.constexpr):
    """rope(x) (R, D) fp32 (OUT_DT values) of the heads `heads` (R,) of one row (no q/k norm),
    x at x_ptr + head · stride_h (a SplitSum's partials at stride_s, `load_sum`), cos / sin
    at row cs_row (D,) (every lane the row) of their (P, D) tables of row stride stride_c
    (zeros where not cs_ok (D,)): the
    module docstring's ops on whole heads, element i beside its partner j = (i + D/2) mod D
    (rotate_half(x)_i = -x_j for i < D/2, x_j after), the partner loaded again rather than
    moved across lanes: `_norm_rope`'s values bit for bit. Needs each product rounded apart
    from the sum: a 16-bit OUT_DT (its roundings between them) or fp contraction off."""
    offs = tl.arange(0, D)
    part = (offs + D // 2) % D
    m = head_ok[:, None] & (offs < D)[None, :]
    xp = x_ptr + heads[:, None] * stride_h
    bp = bias_ptr + heads[:, None] * D
    x = load_sum(xp + offs[None, :], m, stride_s, bp + offs[None, :], SPLITS, HAS_BIAS, X_DT,
                 INTERP)
    xj = load_sum(xp + part[None, :], m, stride_s, bp + part[None, :], SPLITS, HAS_BIAS, X_DT,
                  INTERP)
    c = tl.load(cos_ptr + cs_row * stride_c + offs, mask=cs_ok, other=0.0)
    sn = tl.load(sin_ptr + cs_row * stride_c + offs, mask=cs_ok, other=0.0)
    sign = tl.where(offs < D // 2, -1.0, 1.0)[None, :]  # rotate_half's sign: exact
    return _round(_round(x * c.to(tl.float32)[None, :], OUT_DT, INTERP)
                  + sign * _round(xj * sn.to(tl.float32)[None, :], OUT_DT, INTERP),
                  OUT_DT, INTERP)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, ck_ptr, cv_ptr, slot_ptr, qo_ptr,
    qb_ptr, kb_ptr, vb_ptr,
    G, D, M, P, eps_q, eps_k,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_sb,
    stride_ckb, stride_ckh, stride_ckm, stride_cvb, stride_cvh, stride_cvm,
    stride_ob, stride_oh, stride_qs, stride_ks, stride_vs,
    X_DT: tl.constexpr, Q_SPLITS: tl.constexpr, K_SPLITS: tl.constexpr, V_SPLITS: tl.constexpr,
    HAS_QB: tl.constexpr, HAS_KB: tl.constexpr, HAS_VB: tl.constexpr,
    NORM: tl.constexpr, TABLES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr, INTERP: tl.constexpr,
):
    """Program (b, h): query heads h·G .. h·G + G - 1, key and value head h of row b. q, k, v
    hold X_DT values; each may be a `split_sum.SplitSum` (its _SPLITS > 0): its partials at
    ptr + s · stride_s and its bias (HAS_*B, one (heads · D,) vector) summed here
    (`load_sum`). TABLES: cos and sin are P rows over positions, row b's at row slots_b."""
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    half = D // 2
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    OUT_DT: tl.constexpr = qo_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + b + offs * 0).to(tl.int64)  # (BLOCK_HALF,), all lanes slots_b
    if TABLES:  # a slot past the table reads zeros (and is not written below)
        cs_row = slot
        cs_ok = mask & (slot >= 0) & (slot < P)
    else:
        cs_row = b
        cs_ok = mask
    c1 = tl.load(cos_ptr + cs_row * stride_cb + offs, mask=cs_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs_row * stride_cb + half + offs, mask=cs_ok, other=0.0)
    s1 = tl.load(sin_ptr + cs_row * stride_sb + offs, mask=cs_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs_row * stride_sb + half + offs, mask=cs_ok, other=0.0)
    c1, s1 = c1[None, :], s1[None, :]
    c2, s2 = c2.to(tl.float32)[None, :], s2.to(tl.float32)[None, :]

    # the G query heads of kv head h: (BLOCK_G, BLOCK_HALF) per half
    g = tl.arange(0, BLOCK_G)
    mq = (g < G)[:, None] & mask[None, :]
    heads = h * G + g
    qp = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs[None, :]
    qb = qb_ptr + heads[:, None] * D + offs[None, :]
    q1 = load_sum(qp, mq, stride_qs, qb, Q_SPLITS, HAS_QB, X_DT, INTERP)
    q2 = load_sum(qp + half, mq, stride_qs, qb + half, Q_SPLITS, HAS_QB, X_DT, INTERP)
    o1, o2 = _norm_rope(q1, q2, qw_ptr, c1, c2, s1, s2, offs, mask, eps_q, D,
                        X_DT, OUT_DT, NORM, INTERP)
    op = qo_ptr + b * stride_ob + heads[:, None] * stride_oh + offs[None, :]
    tl.store(op, o1.to(OUT_DT), mask=mq)  # o1 already holds OUT_DT values: exact casts
    tl.store(op + half, o2.to(OUT_DT), mask=mq)

    # key head h -> K[b, h, slot], value head h -> V[b, h, slot]
    ok = mask & (slot >= 0) & (slot < M)
    mk = mask[None, :]
    kp = k_ptr + b * stride_kb + h * stride_kh + offs[None, :]
    kb = kb_ptr + h * D + offs[None, :]
    k1 = load_sum(kp, mk, stride_ks, kb, K_SPLITS, HAS_KB, X_DT, INTERP)
    k2 = load_sum(kp + half, mk, stride_ks, kb + half, K_SPLITS, HAS_KB, X_DT, INTERP)
    r1, r2 = _norm_rope(k1, k2, kw_ptr, c1, c2, s1, s2, offs, mask, eps_k, D,
                        X_DT, OUT_DT, NORM, INTERP)
    C_DT: tl.constexpr = ck_ptr.dtype.element_ty
    kc = ck_ptr + b * stride_ckb + h * stride_ckh + (slot * stride_ckm + offs)[None, :]
    tl.store(kc, to_dtype(r1, C_DT, INTERP), mask=ok[None, :])  # k.to(cache dtype)
    tl.store(kc + half, to_dtype(r2, C_DT, INTERP), mask=ok[None, :])
    vp = v_ptr + b * stride_vb + h * stride_vh + offs
    vc = cv_ptr + b * stride_cvb + h * stride_cvh + slot * stride_cvm + offs
    vb = vb_ptr + h * D + offs
    v1 = load_sum(vp, mask, stride_vs, vb, V_SPLITS, HAS_VB, X_DT, INTERP)
    v2 = load_sum(vp + half, mask, stride_vs, vb + half, V_SPLITS, HAS_VB, X_DT, INTERP)
    V_DT: tl.constexpr = cv_ptr.dtype.element_ty
    tl.store(vc, to_dtype(v1, V_DT, INTERP), mask=ok)
    tl.store(vc + half, to_dtype(v2, V_DT, INTERP), mask=ok)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm_torch(x, norm):
    """Qwen3RMSNorm's forward with (weight, eps) = norm."""
    w, eps = norm
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + eps)).to(x.dtype)


def rope_cache_write_torch(q, k, v, cos, sin, cache_k, cache_v, slots, *, q_norm=None,
                           k_norm=None):
    """The same in torch ops, as transformers' attention and the decode loop's cache write."""
    if q_norm is not None:
        q, k = _norm_torch(q, q_norm), _norm_torch(k, k_norm)
    c, s = cos[:, None], sin[:, None]  # (B, 1, D) over the heads
    q_rot = q * c + _rotate_half(q) * s
    k_rot = k * c + _rotate_half(k) * s
    rows = torch.arange(q.shape[0], device=q.device)
    cache_k[rows, :, slots] = k_rot.to(cache_k.dtype)  # target view (B, Hkv, D)
    cache_v[rows, :, slots] = v.to(cache_v.dtype)
    return q_rot


def check_inputs(q, k, v, cos, sin, cache_k, cache_v, slots, q_norm, k_norm, tables):
    """ValueError naming the argument of `rope_cache_write` (and `rope_attention`) that is bad."""
    B, Hq, D = q.shape
    if k.dim() != 3 or k.shape[0] != B or k.shape[2] != D or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, Hkv, D) "
                         f"= ({B}, Hkv, {D}) for q {tuple(q.shape)}")
    Hkv = k.shape[1]
    if Hq % Hkv or D % 2:
        raise ValueError(f"q has {Hq} heads of dim {D}, k has {Hkv}: need Hq % Hkv == 0 and an "
                         "even head dim")
    rows = "P" if tables else B
    if cos.dim() != 2 or cos.shape[1] != D or sin.shape != cos.shape or \
            (not tables and cos.shape[0] != B):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be ({rows}, D) "
                         f"= ({rows}, {D}) (a rotary dim below the head dim is not supported)")
    if cache_k.dim() != 4 or cache_k.shape[:2] != (B, Hkv) or cache_k.shape[3] != D \
            or cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_k {tuple(cache_k.shape)} and cache_v {tuple(cache_v.shape)} "
                         f"must both be (B, Hkv, M, D) = ({B}, {Hkv}, M, {D})")
    if slots.shape != (B,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots is {tuple(slots.shape)} {slots.dtype}, expected ({B},) int")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together (Qwen3 has both)")
    if q_norm is not None:
        for name, (w, _) in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w.shape != (D,) or w.dtype not in (q.dtype, torch.float32):
                raise ValueError(f"{name} weight is {tuple(w.shape)} {w.dtype}, expected ({D},) "
                                 f"in {q.dtype} or float32")
        if q_norm[0].dtype != k_norm[0].dtype:
            raise ValueError(f"q_norm weight is {q_norm[0].dtype}, k_norm's {k_norm[0].dtype}")


def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     slots: torch.Tensor, *, q_norm: tuple | None = None,
                     k_norm: tuple | None = None, tables: bool = False) -> torch.Tensor:
    """Rotated q (B, Hq, D); writes rotated k and v to slot slots_b of row b of cache_k and
    cache_v (module docstring). q_norm / k_norm: (weight (D,), eps) of Qwen3's per-head norms
    (`norm_params`), applied before the rotation. `tables`: cos and sin are (P, D) over
    positions and row b takes row slots_b of them (its position is its slot, as in the decode
    loop's caches), instead of (B, D) rows; no gather launch. Each of q, k, v may be a
    projection's `split_sum.SplitSum` (viewed per head): its partials are summed here, the same
    bits as the projection's own sum. Triton on CUDA and under the interpreter, the torch ops
    elsewhere. Any strides with a contiguous head dim."""
    check_inputs(q, k, v, cos, sin, cache_k, cache_v, slots, q_norm, k_norm, tables)
    if not (q.device.type == "cuda" or interpreting()):
        q, k, v = (t.materialize() if isinstance(t, SplitSum) else t for t in (q, k, v))
        if tables:
            cos, sin = cos[slots], sin[slots]
        return rope_cache_write_torch(q, k, v, cos, sin, cache_k, cache_v, slots,
                                      q_norm=q_norm, k_norm=k_norm)
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    x_dtype = q.dtype
    tensors = [t if isinstance(t, SplitSum) or t.stride(-1) == 1 else t.contiguous()
               for t in (q, k, v, cos, sin)]
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        if c.stride(-1) != 1:  # written in place: a copy would lose the write
            raise ValueError(f"{name} has strides {c.stride()}; its head dim must be contiguous")
    q, k, v, cos, sin = tensors
    CONSUMED["rope_cache_write"] += sum(isinstance(t, SplitSum) for t in (q, k, v))
    (q, q_s, q_b, q_n), (k, k_s, k_b, k_n), (v, v_s, v_b, v_n) = (
        kernel_args(t, tuple(t.shape)) for t in (q, k, v))
    y_dtype = x_dtype if q_norm is None else torch.promote_types(q_norm[0].dtype, x_dtype)
    out = torch.empty(B, Hq, D, device=q.device, dtype=torch.promote_types(y_dtype, cos.dtype))
    qw, eps_q = q_norm if q_norm is not None else (q, 0.0)  # q: never read (NORM=False)
    kw, eps_k = k_norm if k_norm is not None else (q, 0.0)
    G = Hq // Hkv
    block_half = triton.next_power_of_2(D // 2)
    _rope_cache_kernel[(B, Hkv)](
        q, k, v, cos, sin, qw, kw, cache_k, cache_v, slots, out,
        *(bias if bias is not None else cos for bias in (q_b, k_b, v_b)),
        G, D, cache_k.shape[2], cos.shape[0], float(eps_q), float(eps_k),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        out.stride(0), out.stride(1), q_s, k_s, v_s,
        X_DT=ROPE_DTYPES[x_dtype], Q_SPLITS=q_n, K_SPLITS=k_n, V_SPLITS=v_n,
        HAS_QB=q_b is not None, HAS_KB=k_b is not None, HAS_VB=v_b is not None,
        NORM=q_norm is not None, TABLES=tables, BLOCK_G=triton.next_power_of_2(G),
        BLOCK_HALF=block_half,
        INTERP=interpreting(), num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # products and sums rounded separately, as torch's ops
        **launch_args(_rope_cache_kernel, q.device),
    )
    return out


def norm_params(attn) -> tuple[tuple, tuple] | None:
    """((q weight, eps), (k weight, eps)) of an attention module's q_norm / k_norm (Qwen3), None
    without them; ValueError for a norm whose forward is not LlamaRMSNorm's."""
    if not hasattr(attn, "q_norm"):
        return None
    return rmsnorm_params(attn.q_norm), rmsnorm_params(attn.k_norm)
