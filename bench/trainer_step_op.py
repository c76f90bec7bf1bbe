"""The distillation op alone (bench.trainer_step --parts op), and the fp64 references behind every
accuracy column of bench.trainer_step.

The op: the per-token generalized Jensen-Shannon divergence between a student's and a teacher's
next-token distributions, from hidden states and LM heads, never as (N, V) logits where the
implementation avoids it (TRL's and Liger's convention for β):

    z_s = h_s W_sᵀ / τ,  z_t = h_t W_tᵀ / τ   (N, V);   p = softmax(z),  m = (1 − β) p_s + β p_t
    D_n = β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m)      (β = 0: KL(p_t ‖ p_s), β = 1: KL(p_s ‖ p_t))
    loss = Σ_n D_n / N;   the gradient goes to h_s only (W_s frozen as under LoRA, teacher constant)

Inputs (seeded, bf16): W_s, W_t (V, H) of std 0.02, h_s, h_t (N, H) scaled so that each model's
logits have std --logit-std; student and teacher are independent draws.

Variants (`BASE_VARIANTS` and `OURS_OPS`; one that cannot run is an n/a row with the reason):

    eager           torch autograd over both models' fp32 logits, (N, V) each, materialized:
                    the student's z_s = h_s.float() @ W_s.float()ᵀ (the bf16 operands upcast, an
                    fp32 GEMM that autograd differentiates: dh_s = dz_s @ W_s.float() in fp32,
                    then cast to bf16), the teacher's z_t = mm32(h_t, W_tᵀ) under no_grad (the
                    bf16 GEMM with an fp32 output); same logits as the floor's up to
                    accumulation order. Its memory counts the fp32 copy of W_s (V·H·4 bytes,
                    kept for the backward) and of h_s
    trl             trl.kernels.chunked_divergence.ChunkedDivergenceFunction (TRL 1.16's
                    DistillationTrainer loss): per-token D and the student's entropy
    liger           liger_kernel.chunked_loss.LigerFusedLinearJSDLoss(weight_hard_loss=0,
                    weight_soft_loss=1): the mean loss only (no per-token output); computes dW_s
                    whether W_s needs it or not; torch.compile'd chunks on CUDA (its default)
    chunked_linear  grpo_lce.chunked_linear over the student head with a torch fn that makes the
                    teacher's fp32 logits of the same rows and D (bench-local fn: the generic
                    path over grpo_lce's public API, usable before a dedicated op exists)
    ours_*          `OURS_OPS`: the divergence op's entry points, "module:function", called as
                    fn(h_s, W_s, h_t, W_t, beta=β, temperature=τ) -> D (N,) fp32 (or a tuple
                    whose first item is D). Placeholders until the op is merged: change them in
                    OURS_OPS or with --ours-ops name=module:function,...

Per (shape, variant): median ms of loss forward + backward (dh_s) with the 20/80 % spread
(`bench.common.time_ms`: triton.testing.do_bench on CUDA), the first call's seconds (Liger's
compile), the extra peak memory of one call (returned dh_s included), max |D − D₆₄| over all N
tokens, |loss − loss₆₄|, and max |dh_s − dh_s,₆₄| / max |dh_s,₆₄| on the first --ref-rows rows.
Beside them, the floor: the bf16 inputs' exact products accumulated in fp32 and stored in fp32
(cuBLAS with an fp32 output), then D in fp64: the error no method that reads bf16 and
accumulates in fp32 can avoid.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import common as bc
from grpo_lce.reference import divergence_of_logprobs

# name -> (N tokens, H, V): the Llama-3.2-1B and 3.1-8B heads over 8 sequences of 1024 tokens
OP_SHAPES = {"1b": (8192, 2048, 128256), "8b": (8192, 4096, 128256), "tiny": (128, 64, 1024)}

# The divergence op's entry points (see the module docstring); not importable -> n/a.
OURS_OPS = {  # grpo_lce.linear_divergence's two methods (see its module docstring)
    "ours_basis": "grpo_lce:linear_divergence?method=basis",
    "ours_chunked": "grpo_lce:linear_divergence?method=chunked",
}
BASE_VARIANTS = ("eager", "trl", "liger", "chunked_linear")
LABEL = {
    "eager": "torch eager (fp32 logits materialized; student: fp32 GEMM of upcast bf16)",
    "trl": "TRL 1.16 ChunkedDivergenceFunction",
    "liger": "Liger 0.8.5 LigerFusedLinearJSDLoss",
    "chunked_linear": "grpo_lce.chunked_linear + torch JSD fn (bench)",
}


class Unavailable(Exception):
    """The variant cannot run here; the message says why."""


# ----------------------------------------------------------------------------- math, references


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and stored in fp32 (cuBLAS fp32 output for bf16 on CUDA). Only for
    inputs that need no grad: torch.mm with out_dtype has no derivative."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def jsd_from_logits(z_s: torch.Tensor, z_t: torch.Tensor, beta: float) -> torch.Tensor:
    """D per row (C,) from logits (C, V), in their dtype (module docstring)."""
    ls, lt = F.log_softmax(z_s, -1), F.log_softmax(z_t, -1)  # (C, V) each
    return divergence_of_logprobs(ls, lt, beta)


def _rows(V: int, itemsize: int = 8) -> int:
    return max(1, (256 * 2**20) // (V * itemsize))  # a 256 MiB logits block per model


def divergence_ref(h_s, W_s, h_t, W_t, *, beta, temperature=1.0, floor=False):
    """D (N,) in fp64 from the inputs as given, a few hundred rows at a time. `floor`: the
    logits are the fp32-output GEMM of the inputs (then fp64), not fp64 products."""
    W_s64, W_t64 = (None, None) if floor else (W_s.double(), W_t.double())
    out = torch.empty(h_s.shape[0], dtype=torch.float64, device=h_s.device)
    C = _rows(W_s.shape[0])
    for s in range(0, h_s.shape[0], C):
        if floor:
            z_s = mm32(h_s[s:s + C], W_s.t()).double()
            z_t = mm32(h_t[s:s + C], W_t.t()).double()
        else:
            z_s, z_t = h_s[s:s + C].double() @ W_s64.t(), h_t[s:s + C].double() @ W_t64.t()
        out[s:s + C] = jsd_from_logits(z_s / temperature, z_t / temperature, beta)
    return out


def divergence_grad_ref(h_s, W_s, h_t, W_t, *, beta, temperature, n_total):
    """d(Σ_rows D / n_total)/dh_s (R, H) in fp64 for the rows given."""
    x = h_s.double().requires_grad_(True)
    z_s = x @ W_s.double().t() / temperature
    z_t = h_t.double() @ W_t.double().t() / temperature
    (g,) = torch.autograd.grad(jsd_from_logits(z_s, z_t, beta).sum() / n_total, (x,))
    return g


def logprobs_ref_rows(h, W, y, *, floor=False):
    """log p(y) (N,) in fp64 from the inputs as given (rows never ignored), chunked.
    `floor`: logits from the fp32-output GEMM of the inputs, log-softmax in fp64."""
    W64 = None if floor else W.double()
    out = torch.empty(h.shape[0], dtype=torch.float64, device=h.device)
    C = _rows(W.shape[0])
    for s in range(0, h.shape[0], C):
        z = mm32(h[s:s + C], W.t()).double() if floor else h[s:s + C].double() @ W64.t()
        out[s:s + C] = torch.log_softmax(z, -1).gather(-1, y[s:s + C, None]).squeeze(-1)
    return out


# ----------------------------------------------------------------------------- variants
# make_<name>(beta, temperature, compiled) -> fn(h_s, W_s, h_t, W_t, y) -> (D (N,) or None, loss);
# `compiled`: Liger's torch.compile switch (True on CUDA, its default), ignored by the others


def make_eager(beta, temperature, compiled):
    def fn(h_s, W_s, h_t, W_t, y):
        # bf16 values and their products are exact in fp32 (and in TF32), so this fp32 GEMM
        # gives mm32's logits up to accumulation order, and unlike mm32 it has a derivative
        z_s = h_s.float() @ W_s.float().t() / temperature  # (N, V) fp32 <- the big tensors
        with torch.no_grad():
            z_t = mm32(h_t, W_t.t()) / temperature  # (N, V) fp32
        d = jsd_from_logits(z_s, z_t, beta)
        return d, d.sum() / d.shape[0]
    return fn


def make_trl(beta, temperature, compiled):
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    except Exception as exc:  # any import failure makes it n/a
        raise Unavailable(f"not importable: {bc.short_error(exc)}") from exc

    def fn(h_s, W_s, h_t, W_t, y):
        d, _entropy = ChunkedDivergenceFunction.apply(h_s, W_s, None, h_t, W_t, None, beta,
                                                      temperature, 1.0, None, 1.0, None)
        return d, d.sum() / d.shape[0]
    return fn


def make_liger(beta, temperature, compiled):
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except Exception as exc:  # any import failure makes it n/a
        raise Unavailable(f"not importable: {bc.short_error(exc)}") from exc
    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta,
                                      temperature=temperature, compiled=compiled)

    def fn(h_s, W_s, h_t, W_t, y):
        return None, loss_fn(h_s, W_s, h_t, W_t, y)
    return fn


def make_chunked_linear(beta, temperature, compiled):
    import grpo_lce

    def fn(h_s, W_s, h_t, W_t, y):
        def rows_fn(z_s, h_t_rows):  # z_s (C, V) fp32, h_t_rows (C, H)
            z_t = mm32(h_t_rows, W_t.t())  # (C, V) fp32, the teacher's rows only
            return jsd_from_logits(z_s / temperature, z_t / temperature, beta)
        d = grpo_lce.chunked_linear(rows_fn, h_s, W_s, h_t)
        return d, d.sum() / d.shape[0]
    return fn


def make_ours(spec: str):
    """spec "module:function[?key=value&...]": the keyword options are passed as strings."""
    spec, _, query = spec.partition("?")
    options = dict(kv.split("=", 1) for kv in query.split("&") if kv)

    def make(beta, temperature, compiled):
        module, _, name = spec.partition(":")
        try:
            op = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise Unavailable(f"not available ({bc.short_error(exc, 100)})") from exc

        def fn(h_s, W_s, h_t, W_t, y):
            d = op(h_s, W_s, h_t, W_t, beta=beta, temperature=temperature, **options)
            d = d[0] if isinstance(d, tuple) else d
            return d, d.sum() / d.shape[0]
        return fn
    return make


def make_variant(name: str, beta: float, temperature: float, compiled: bool,
                 ours_ops: dict | None = None) -> Callable:
    """fn(h_s, W_s, h_t, W_t, y) -> (D or None, loss) of variant `name`; Unavailable if not."""
    ours_ops = OURS_OPS if ours_ops is None else ours_ops
    if name in ours_ops:
        return make_ours(ours_ops[name])(beta, temperature, compiled)
    makers = {"eager": make_eager, "trl": make_trl, "liger": make_liger,
              "chunked_linear": make_chunked_linear}
    if name not in makers:
        raise Unavailable(f"unknown variant {name!r}")
    return makers[name](beta, temperature, compiled)


def first_ours(beta, temperature, ours_ops=None):
    """(name, fn) of the first importable `ours_*` variant, or (None, the reasons)."""
    reasons = []
    for name in (ours_ops or OURS_OPS):
        try:
            return name, make_variant(name, beta, temperature, False, ours_ops)
        except Unavailable as exc:
            reasons.append(str(exc))
    return None, "; ".join(reasons) or "no ours_* variant"


# ----------------------------------------------------------------------------- the benchmark


def make_inputs(N, H, V, device, *, logit_std, seed):
    """h_s, W_s, h_t, W_t bf16 and labels y (N,) (module docstring)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w_std = 0.02
    h_std = logit_std / (w_std * math.sqrt(H))  # z = h·w has std h_std · w_std · √H
    dtype = torch.bfloat16

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    W_s, W_t = randn(V, H, std=w_std), randn(V, H, std=w_std)  # (V, H) each
    h_s, h_t = randn(N, H, std=h_std), randn(N, H, std=h_std)  # (N, H) each
    y = torch.randint(0, V, (N,), generator=gen, device=device)  # Liger's labels (all valid)
    return h_s, W_s, h_t, W_t, y


def run_op_bench(shape: str, args, write) -> None:
    """Every variant at OP_SHAPES[shape]; one record per variant through `write`."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    N, H, V = OP_SHAPES[shape]
    beta, tau = args.beta, args.temperature
    h_s, W_s, h_t, W_t, y = make_inputs(N, H, V, device, logit_std=args.logit_std, seed=0)
    R = min(args.ref_rows, N)
    d64 = divergence_ref(h_s, W_s, h_t, W_t, beta=beta, temperature=tau)
    loss64 = d64.mean().item()
    dh64 = divergence_grad_ref(h_s[:R], W_s, h_t[:R], W_t, beta=beta, temperature=tau,
                               n_total=N)
    floor = divergence_ref(h_s, W_s, h_t, W_t, beta=beta, temperature=tau, floor=True)
    base = {"kind": "op", "shape": shape, "N": N, "H": H, "V": V, "beta": beta,
            "temperature": tau, "logit_std": args.logit_std, "ref_rows": R,
            "loss_ref": loss64, "floor_div_err": (floor - d64).abs().max().item(),
            "floor_loss_err": abs(floor.mean().item() - loss64)}
    del floor
    for name in args.op_variants:
        rec = {**base, "variant": name,
               "label": LABEL.get(name) or f"grpo_lce {name} ({args.ours_ops.get(name)})"}
        if time.time() > args.deadline:
            write({**rec, "status": "skipped: time budget"})
            continue
        hh = h_s.detach().requires_grad_(True)
        try:
            compiled = cuda if args.liger_compile == "auto" else args.liger_compile == "on"
            fn = make_variant(name, beta, tau, compiled, args.ours_ops)

            def step(fn=fn, hh=hh):
                d, loss = fn(hh, W_s, h_t, W_t, y)
                (dh,) = torch.autograd.grad(loss, (hh,))
                return (None if d is None else d.detach()), loss.detach(), dh

            t0 = time.perf_counter()
            d, loss, dh = step()
            bc.sync(device)
            rec["first_call_s"] = time.perf_counter() - t0
            if d is not None:
                rec["div_err"] = (d.double() - d64).abs().max().item()
            rec["loss_err"] = abs(loss.item() - loss64)
            rec["dh_rel_err"] = ((dh[:R].double() - dh64).abs().max()
                                 / dh64.abs().max()).item()
            del d, loss, dh
            bc.free_memory()
            _, rec["extra_bytes"] = bc.peak_extra_bytes(step, device)
            bc.free_memory()
            rec.update(bc.time_ms(step, device, min_reps=args.op_reps))
            rec["status"] = "ok"
        except Unavailable as exc:
            rec["status"] = f"n/a: {exc}"
        except Exception as exc:  # noqa: BLE001 - recorded; the next variant runs
            import traceback

            traceback.print_exc()
            rec["status"] = bc.short_error(exc, 300)
        hh = None
        bc.free_memory()
        write(rec)
        print(f"[op {shape} {name}] {rec['status']}"
              + (f" {rec['ms']:.2f} ms" if "ms" in rec else ""), flush=True)


def op_table(recs: list[dict]) -> str:
    """The op records (newest per (shape, variant)) as a markdown table."""
    newest: dict = {}
    for r in recs:
        key = (r["shape"], r["variant"])
        if r.get("status") == "ok" or newest.get(key, {}).get("status") != "ok":
            newest[key] = r
    if not newest:
        return ""
    order = {v: i for i, v in enumerate(BASE_VARIANTS)}
    lines = [("| shape (N, H, V) | variant | ms (p20-p80) | vs TRL | first call s | peak extra "
              "GiB | max abs D err | loss err | dh rel err | floor D err | commit |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    trl_ms = {r["shape"]: r["ms"] for r in newest.values()
              if r["variant"] == "trl" and r.get("status") == "ok"}

    def e(v):
        return "" if v is None else f"{v:.1e}"

    for r in sorted(newest.values(), key=lambda r: (r["shape"], order.get(r["variant"], 99))):
        shape = f"{r['shape']} ({r['N']}, {r['H']}, {r['V']})" if "N" in r else r["shape"]
        label = r.get("label") or LABEL.get(r["variant"], r["variant"])
        if r.get("status") != "ok":
            lines.append(f"| {shape} | {label} | {r['status']} | | | | | | | | "
                         f"{r.get('commit', '')} |")
            continue
        ref = trl_ms.get(r["shape"])
        extra = r.get("extra_bytes")
        cells = [shape, label, f"{r['ms']:.2f} ({r['p20']:.2f}-{r['p80']:.2f})",
                 f"{r['ms'] / ref:.2f}x" if ref else "", f"{r['first_call_s']:.2f}",
                 "" if extra is None else f"{extra / 2**30:.2f}", e(r.get("div_err")),
                 e(r.get("loss_err")), e(r.get("dh_rel_err")), e(r.get("floor_div_err")),
                 r.get("commit", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
