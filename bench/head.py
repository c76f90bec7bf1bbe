"""LM-head benchmark: grpo_lce side by side with every other way to get log-probs / CE from (h, W).

h (N, H) bf16, W (V, H) bf16 (std 0.02, h scaled so the logits have std `--logit-std`),
targets y (N,) sampled from softmax(h Wᵀ) (as GRPO completions are), upstream gradient g (N,).

    case  what                                            floor (cuBLAS X @ Wᵀ, bf16)
    i     logp fwd+bwd, frozen W, dlogp = g (any grads)    2 GEMMs
    ii    logp + entropy, torch.no_grad()                  1 GEMM
    iii   CE mean fwd+bwd, trainable W (dh and dW)         3 GEMMs
    iv    CE mean fwd+bwd, frozen W (dh)                   2 GEMMs

Competitors, all in one process on the same tensors: torch eager (bf16 logits, then fp32
log_softmax), torch.compile of the same function, TRL 1.16 `trl.kernels.ChunkedLogProbFunction`,
Liger-Kernel `liger_fused_linear_cross_entropy`, Apple `cut_cross_entropy.linear_cross_entropy`,
grpo_lce, and one cuBLAS GEMM as the floor. A competitor that is missing, unsupported or runs
out of memory is an n/a row with the reason; the run goes on.

Per (shape, case, competitor): median ms with the 20-80 % spread (`triton.testing.do_bench`;
`time.perf_counter` without CUDA), extra peak MiB of one call (returned gradients included),
max |logp − fp64| and |entropy − fp64| over the first `--ref-rows` rows, the relative error of
dh on those rows, |loss − fp64| for CE, and ms / (k × GEMM) against the case's floor; for
grpo_lce also that ratio paired: the median over rounds timing the floor and grpo_lce back to
back (see `paired_rounds`).
Before timing, grpo_lce is checked against the fp64 reference; the run aborts if it is off.

Accuracy in two regimes, per shape (`accuracy_rows`), no grad, logp and entropy of the first
`--ref-rows` rows against fp64: "flat" on the timing inputs (random logits of std
`--logit-std`: max p ~ 1e-4 at V = 128k) and "peaked" on inputs where every row has one logit
lifted above the rest so that the median max p is `--peak-p` (0.4, as in a trained model's
sampled tokens; |z| reaches ~12-16 there, so every rounding of a logit costs more). Beside each:
the floor, a GEMM with fp32 output on the same bf16 inputs (exact bf16 products, fp32
accumulation: `torch.mm(h, W.t(), out_dtype=torch.float32)`, cuBLAS) and then an fp64
log-softmax, i.e. the error no method that reads bf16 inputs and accumulates in fp32 can avoid;
and each competitor's error as a multiple of it.

GPU (from the project root, `.whl/` filled by ../shared/gpu/wheels.sh and carried; aimed at
~6 min on an H100 for the three shapes, torch.compile's compilations included):

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; python3 -m bench.head

    python3 -m bench.head --quick                         # smoke shape, ~1 min
    python3 -m bench.head --shapes llama-1b --cases i,ii --competitors trl,grpo_lce

CPU smoke run (eager, torch.compile, TRL and grpo_lce's torch fallback; no CUDA timers):

    python3 -m bench.head --quick --device cpu

Writes bench/results/bench_head_<GPU>.json and .md (and .png when matplotlib is there);
`--quick` runs write bench_head_<GPU>_quick.*.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import grpo_lce
from bench import common as bc
from grpo_lce.reference import logits_ref, logprobs_ref

# name -> (N tokens, H hidden, V vocabulary)
SHAPES = {
    "llama-1b": (8192, 2048, 128256),  # Llama-3.2-1B head, 8 x 1024 tokens
    "llama-8b": (16384, 4096, 128256),  # Llama-3.1-8B head, 16 x 1024 tokens
    "qwen-0.5b": (8192, 896, 151936),  # Qwen2.5-0.5B head: small H, large V
}
QUICK_SHAPE = {"quick": (1024, 256, 8000)}

# case -> (description, GEMMs in the floor)
CASES = {
    "i": ("logp fwd+bwd, frozen W", 2),
    "ii": ("logp+entropy, no grad", 1),
    "iii": ("CE mean fwd+bwd, trainable W", 3),
    "iv": ("CE mean fwd+bwd, frozen W", 2),
}

# TRL 1.16 passes this vocabulary tile width (trl/trainer/utils.py, _CHUNKED_LOGPROB_CHUNK_SIZE)
TRL_CHUNK_SIZE = 32768


class Unsupported(Exception):
    """The competitor has no API for this case."""


# ------------------------------------------------------------------------------- competitors
# Each gives logp(h, W, y, with_entropy) -> (logp (N,) fp32, entropy (N,) or None) and/or
# ce(h, W, y) -> mean CE scalar; autograd does the rest (see make_step).


def _eager_logp(h, W, y):
    logits = h @ W.t()  # (N, V) bf16 <- the big tensor, rounded to bf16
    logp_all = logits.float().log_softmax(-1)  # (N, V) fp32
    return logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _eager_logp_entropy(h, W, y):
    logp_all = (h @ W.t()).float().log_softmax(-1)  # (N, V) fp32
    logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _eager_ce(h, W, y):
    # what transformers' ForCausalLMLoss does with bf16 lm_head logits
    return F.cross_entropy((h @ W.t()).float(), y)


@dataclass
class Competitor:
    name: str
    call: str  # the exact API call, for the report
    logp: Callable | None = None
    ce: Callable | None = None
    gpu_only: bool = False
    notes: dict = field(default_factory=dict)  # case -> note
    unavailable: str | None = None  # reason when it cannot run at all


def competitor_eager() -> Competitor:
    def logp(h, W, y, with_entropy):
        return _eager_logp_entropy(h, W, y) if with_entropy else (_eager_logp(h, W, y), None)

    return Competitor(
        "eager",
        "(h @ W.t()).float().log_softmax(-1).gather(y) [+ -(p*logp).sum(-1)]; "
        "CE: F.cross_entropy((h @ W.t()).float(), y)",
        logp=logp,
        ce=_eager_ce,
    )


def competitor_compile() -> Competitor:
    # dynamic=False: one specialised graph per shape and grad mode, as a trainer with fixed
    # shapes gets. Separate functions so each case has its own graph.
    c_logp = torch.compile(_eager_logp, dynamic=False)
    c_logp_ent = torch.compile(_eager_logp_entropy, dynamic=False)
    c_ce = torch.compile(_eager_ce, dynamic=False)

    def logp(h, W, y, with_entropy):
        return c_logp_ent(h, W, y) if with_entropy else (c_logp(h, W, y), None)

    return Competitor(
        "compile",
        "torch.compile(eager function, dynamic=False); first_call_ms includes compilation",
        logp=logp,
        ce=c_ce,
    )


def competitor_trl() -> Competitor:
    call = (
        "trl.kernels.ChunkedLogProbFunction.apply(h, W, None, y, 1.0, chunk, None, 1.0, outputs) "
        "with outputs=() or ('entropy',); CE = -logp.mean() (TRL SFT's fused-head loss)"
    )
    try:
        import trl
        from trl.kernels import ChunkedLogProbFunction
    except Exception as exc:  # noqa: BLE001 - any import failure makes it n/a
        return Competitor("trl", call, unavailable=f"not importable: {bc.short_error(exc)}")
    chunk = TRL_CHUNK_SIZE
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except Exception:  # noqa: BLE001 - keep the documented default
        pass

    def logp(h, W, y, with_entropy):
        outputs = ("entropy",) if with_entropy else ()
        lp, ent, *_ = ChunkedLogProbFunction.apply(h, W, None, y, 1.0, chunk, None, 1.0, outputs)
        return lp, ent

    def ce(h, W, y):
        return -logp(h, W, y, False)[0].mean()

    return Competitor(
        "trl", call.replace("chunk", str(chunk)) + f" [trl {trl.__version__}]", logp=logp, ce=ce
    )


def competitor_liger() -> Competitor:
    call = (
        "liger_kernel.transformers.functional.liger_fused_linear_cross_entropy(h, W, y, "
        "reduction='none') -> logp = -nll (per-token grads, recomputed in backward); "
        "CE: same with reduction='mean' (defaults: accum_dtype=None, chunk_mem_const=1)"
    )
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lflce
    except Exception as exc:  # noqa: BLE001
        return Competitor("liger", call, unavailable=f"not importable: {bc.short_error(exc)}")
    version = bc.package_version("liger-kernel") or bc.package_version("liger_kernel")

    def logp(h, W, y, with_entropy):
        return -lflce(h, W, y, reduction="none"), None

    def ce(h, W, y):
        return lflce(h, W, y, reduction="mean")

    return Competitor(
        "liger", call + f" [liger-kernel {version}]", logp=logp, ce=ce, gpu_only=True,
        notes={"ii": "logp only (no entropy output)", "iii": "dW accumulated in bf16 (default)"},
    )


def competitor_cce() -> Competitor:
    call = (
        "cut_cross_entropy.linear_cross_entropy(h, W, y, reduction='none') -> logp = -nll; "
        "CE: reduction='mean' (defaults: impl='cce', filter_eps='high' = gradient skips p < 2^-12)"
    )
    try:
        import cut_cross_entropy
        from cut_cross_entropy import linear_cross_entropy as cce_lce
    except Exception as exc:  # noqa: BLE001
        return Competitor("cce", call, unavailable=f"not importable: {bc.short_error(exc)}")

    def logp(h, W, y, with_entropy):
        return -cce_lce(h, W, y, reduction="none"), None

    def ce(h, W, y):
        return cce_lce(h, W, y, reduction="mean")

    return Competitor(
        "cce", call + f" [cut-cross-entropy {cut_cross_entropy.__version__}]", logp=logp, ce=ce,
        gpu_only=True, notes={"ii": "logp only (no entropy output)"},
    )


def competitor_grpo_lce(chunk_size) -> Competitor:
    def logp(h, W, y, with_entropy):
        out = grpo_lce.linear_logprobs(h, W, y, return_entropy=with_entropy, chunk_size=chunk_size)
        return out if with_entropy else (out, None)

    def ce(h, W, y):
        return grpo_lce.linear_cross_entropy(h, W, y, chunk_size=chunk_size)

    return Competitor(
        "grpo_lce",
        f"grpo_lce.linear_logprobs(h, W, y, return_entropy=case=='ii', chunk_size={chunk_size}); "
        f"CE: grpo_lce.linear_cross_entropy(h, W, y, chunk_size={chunk_size}) "
        f"[grpo_lce {grpo_lce.__version__}]",
        logp=logp,
        ce=ce,
    )


COMPETITORS = ("eager", "compile", "trl", "liger", "cce", "grpo_lce")


def build_competitors(names, chunk_size):
    makers = {
        "eager": competitor_eager,
        "compile": competitor_compile,
        "trl": competitor_trl,
        "liger": competitor_liger,
        "cce": competitor_cce,
        "grpo_lce": lambda: competitor_grpo_lce(chunk_size),
    }
    return [makers[n]() for n in names]


# ------------------------------------------------------------------------------- one call


def make_step(comp: Competitor, case: str, h, W, y, g):
    """A no-argument callable doing the case's whole work once and returning its outputs."""
    if case in ("i", "ii") and comp.logp is None or case in ("iii", "iv") and comp.ce is None:
        raise Unsupported(f"no API for case {case}")
    if case == "i":
        hh = h.detach().requires_grad_(True)

        def step():
            logp, _ = comp.logp(hh, W, y, False)
            (dh,) = torch.autograd.grad(logp, (hh,), g)
            return {"logp": logp.detach(), "dh": dh}

    elif case == "ii":

        def step():
            with torch.no_grad():
                logp, ent = comp.logp(h, W, y, True)
            return {"logp": logp, "entropy": ent}

    else:
        hh = h.detach().requires_grad_(True)
        WW = W.detach().requires_grad_(case == "iii")
        wrt = (hh, WW) if case == "iii" else (hh,)

        def step():
            loss = comp.ce(hh, WW, y)
            grads = torch.autograd.grad(loss, wrt)
            dW = grads[1] if len(grads) > 1 else None
            return {"loss": loss.detach(), "dh": grads[0], "dW": dW}

    return step


# ------------------------------------------------------------------------------- inputs, references


def make_inputs(N, H, V, device, *, logit_std, seed, peak_p=None):
    """h, W, y, g as in the module docstring. With `peak_p`, each row n also gets one logit
    lifted by δ_n above the others (a random token c_n: h_n += δ_n W[c_n] / |W[c_n]|²), δ_n
    spread ±2 around δ = ln(peak_p / (1 − peak_p) · V · e^{σ²/2}), the lift at which the lifted
    token's p is peak_p against V − 1 logits of std σ = logit_std: a median max p near peak_p
    (the bf16 rounding of h moves it a little; `accuracy_rows` reports the measured one)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w_std = 0.02
    h_std = logit_std / (w_std * math.sqrt(H))  # z = h·w has std h_std · w_std · √H
    W = (torch.randn(V, H, generator=gen, device=device) * w_std).to(torch.bfloat16)  # (V, H)
    h = torch.randn(N, H, generator=gen, device=device) * h_std  # (N, H) fp32
    if peak_p is not None:
        delta = math.log(peak_p / (1 - peak_p) * V * math.exp(logit_std**2 / 2))
        c = torch.randint(0, V, (N,), generator=gen, device=device)  # (N,) lifted tokens
        d = delta + 4 * torch.rand(N, generator=gen, device=device) - 2  # (N,) lifts δ_n
        u = W[c].float()  # (N, H)
        h += d[:, None] * u / u.square().sum(-1, keepdim=True)
    h = h.to(torch.bfloat16)  # (N, H)
    y = torch.empty(N, dtype=torch.long, device=device)
    rows = max(1, (256 * 2**20) // (V * 4))
    for s in range(0, N, rows):  # targets sampled from the model itself, C rows at a time
        z = (h[s : s + rows] @ W.t()).float()  # (C, V) fp32
        y[s : s + rows] = torch.multinomial(z.softmax(-1), 1, generator=gen).squeeze(-1)
    g = torch.randn(N, generator=gen, device=device)  # (N,) fp32 upstream grad of logp
    return h, W, y, g


def make_references(h, W, y, g, rows, want_loss):
    """fp64 truths on the first `rows` rows (logp, entropy, dlogp/dh) and the full mean CE."""
    R = min(rows, h.shape[0])
    hr, yr = h[:R], y[:R]
    logp64, ent64 = logprobs_ref(hr, W, yr)
    p = torch.softmax(logits_ref(hr, W), -1)  # (R, V) fp64
    W64 = W.double()  # (V, H) fp64
    dlogp_dh = W64[yr] - p @ W64  # (R, H): ∂logp/∂h = W[y] − pᵀW
    del p
    loss64 = None
    if want_loss:
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        C = max(1, (512 * 2**20) // (W.shape[0] * 8))
        for s in range(0, h.shape[0], C):
            z = h[s : s + C].double() @ W64.t()  # (C, V) fp64
            total += (z.logsumexp(-1) - z.gather(-1, y[s : s + C, None]).squeeze(-1)).sum()
        loss64 = (total / h.shape[0]).item()
    del W64
    N = h.shape[0]
    return {
        "rows": R,
        "logp": logp64,
        "entropy": ent64,
        "dh_i": g[:R, None].double() * dlogp_dh,  # case i: dh = g · ∂logp/∂h
        "dh_ce": -dlogp_dh / N,  # cases iii, iv: d(mean CE)/dh
        "loss": loss64,
    }


def errors(out: dict, ref: dict, case: str) -> dict:
    R = ref["rows"]
    err = {"logp_err": None, "ent_err": None, "dh_rel_err": None, "loss_err": None}
    if out.get("logp") is not None:
        err["logp_err"] = (out["logp"][:R].double() - ref["logp"]).abs().max().item()
    if out.get("entropy") is not None:
        err["ent_err"] = (out["entropy"][:R].double() - ref["entropy"]).abs().max().item()
    if out.get("dh") is not None:
        dh_ref = ref["dh_i"] if case == "i" else ref["dh_ce"]
        e = (out["dh"][:R].double() - dh_ref).abs().max() / dh_ref.abs().max()
        err["dh_rel_err"] = e.item()
    if out.get("loss") is not None and ref["loss"] is not None:
        err["loss_err"] = abs(out["loss"].item() - ref["loss"])
    return err


def floor_logits(h, W):
    """(logits (R, V) fp32, how): the bf16 inputs' exact products accumulated in fp32 and
    stored in fp32 -- cuBLAS with out_dtype where torch has it for the device, else an fp32
    GEMM of the upcast inputs (the same exact products; fp32 matmul precision "highest", so no
    TF32 rounding of the inputs)."""
    try:
        return torch.mm(h, W.t(), out_dtype=torch.float32), "torch.mm(h, W.t(), out_dtype=fp32)"
    except (TypeError, RuntimeError, NotImplementedError):
        if torch.get_float32_matmul_precision() != "highest":
            raise SystemExit("the floor needs torch.set_float32_matmul_precision('highest')")
        return h.float() @ W.float().t(), "h.float() @ W.float().t()"


def accuracy_rows(regime, h, W, y, comps, device, args):
    """Errors vs fp64 (logp, entropy) of every competitor's no-grad logp + entropy on the first
    ref rows, the floor's (fp32-output GEMM, fp64 log-softmax) and the median max p there."""
    R = min(args.ref_rows, h.shape[0])
    logp64, ent64 = logprobs_ref(h[:R], W, y[:R])
    z64 = logits_ref(h[:R], W)  # (R, V) fp64
    median_max_p = torch.softmax(z64, -1).max(-1).values.median().item()
    z_max = z64.abs().max().item()
    del z64
    z32, how = floor_logits(h[:R], W)  # (R, V) fp32
    logp_all = torch.log_softmax(z32.double(), -1)  # (R, V) fp64: no error past the GEMM's
    del z32
    fl = {"logp_err": (logp_all.gather(-1, y[:R, None]).squeeze(-1) - logp64).abs().max().item(),
          "ent_err": (-(logp_all.exp() * logp_all).sum(-1) - ent64).abs().max().item()}
    del logp_all
    base = {"regime": regime, "rows": R, "median_max_p": median_max_p, "max_abs_logit": z_max,
            "floor_logp_err": fl["logp_err"], "floor_ent_err": fl["ent_err"], "floor_call": how}
    out = []
    for comp in comps:
        row = {**base, "competitor": comp.name}
        reason = skip_reason(comp, "ii", h.shape[0], W.shape[0], device, args)
        if reason is None and comp.logp is None:
            reason = "n/a: no log-prob API"
        if reason is None:
            try:
                with torch.no_grad():
                    logp, ent = comp.logp(h, W, y, True)
                row["logp_err"] = (logp[:R].double() - logp64).abs().max().item()
                row["ent_err"] = (None if ent is None
                                  else (ent[:R].double() - ent64).abs().max().item())
                del logp, ent
            except Exception as exc:  # noqa: BLE001 - OOM or a competitor's own failure
                reason = bc.short_error(exc)
        row["status"] = "ok" if reason is None else "n/a"
        if reason is not None:
            row["reason"] = reason
        else:
            row["logp_x_floor"] = row["logp_err"] / fl["logp_err"] if fl["logp_err"] else None
        bc.free_memory()
        out.append(row)
    return out


def format_accuracy(r):
    head = f"{r['regime']:<7} {r['competitor']:<9}"
    if r["status"] != "ok":
        return f"{head} n/a  {r['reason']}"
    return (f"{head} logp {r['logp_err']:8.1e} ({_f(r['logp_x_floor'], '.2f')}x floor "
            f"{r['floor_logp_err']:.1e})  entropy {_f(r['ent_err'], '8.1e')} "
            f"(floor {r['floor_ent_err']:.1e})")


def check_grpo_lce(h, W, y, g, ref, tol, chunk_size):
    """Abort before any timing if grpo_lce disagrees with the fp64 reference."""
    R = ref["rows"]
    hr = h[:R].detach().requires_grad_(True)
    logp, ent = grpo_lce.linear_logprobs(hr, W, y[:R], return_entropy=True, chunk_size=chunk_size)
    (dh,) = torch.autograd.grad(logp, (hr,), g[:R])
    err = errors({"logp": logp, "entropy": ent, "dh": dh}, ref, "i")
    print(
        f"  grpo_lce vs fp64 on {R} rows: logp {err['logp_err']:.2e}  entropy {err['ent_err']:.2e}"
        f"  dh (relative) {err['dh_rel_err']:.2e}"
    )
    # dh is returned in bf16: 2^-8 relative rounding of the largest element is ~4e-3
    if err["logp_err"] > tol or err["ent_err"] > tol or err["dh_rel_err"] > 2e-2:
        raise SystemExit(f"grpo_lce correctness check failed (tol {tol}): {err}")


# ------------------------------------------------------------------------------- driver


def paired_rounds(step, floor_fn, k, device, args):
    """ms / (k × floor) from `args.paired_rounds` rounds, each timing the floor GEMM and then
    the step back to back: both in the same clock and thermal state. The floor of the table is
    timed once per shape, before any competitor, on a GPU that has idled through the fp64
    references; a long run then heats it and lowers its clocks, so the later rows are timed in
    another state than their floor (on an H200 the same qwen-0.5b GEMM measured 3.0 to 3.8 ms
    in one session, depending on what ran before it). The median of the rounds' ratios is the
    paired figure of the summary."""
    ratios = []
    for _ in range(args.paired_rounds):
        fl = bc.time_ms(floor_fn, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                        min_reps=args.min_reps)["ms"]
        ms = bc.time_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                        min_reps=args.min_reps)["ms"]
        ratios.append(ms / (k * fl))
    return ratios


def run_one(comp, case, h, W, y, g, ref, device, args):
    step = make_step(comp, case, h, W, y, g)
    first_ms = bc.time_once_ms(step, device)  # compile / autotune / JIT happen here
    t0 = time.perf_counter()
    out, extra = bc.peak_extra_bytes(step, device)  # synchronizes at the end
    est_ms = (time.perf_counter() - t0) * 1e3
    row = errors(out, ref, case)
    del out
    bc.free_memory()
    row.update(bc.time_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                          min_reps=args.min_reps, est_ms=est_ms))
    row["first_call_ms"] = first_ms
    row["extra_mib"] = None if extra is None else extra / 2**20
    if comp.name == "grpo_lce" and device.type == "cuda" and args.paired_rounds:
        ratios = paired_rounds(step, lambda: torch.mm(h, W.t()), CASES[case][1], device, args)
        row["paired_x_floor"] = statistics.median(ratios)
        row["paired_x_floor_rounds"] = ratios
    return row


def skip_reason(comp, case, N, V, device, args):
    if comp.unavailable:
        return comp.unavailable
    if comp.gpu_only and device.type != "cuda":
        return "needs a CUDA device"
    if comp.name == "eager":
        est = 16 * N * V  # bytes: bf16 logits + fp32 copies kept for backward, ~16 B per logit
        limit = args.eager_max_gib * 2**30
        if device.type == "cuda":
            limit = min(limit, 0.9 * torch.cuda.mem_get_info(device)[0])
        if est > limit:
            return f"skipped: ~{est / 2**30:.0f} GiB of logits-sized tensors"
    return None


def bench_shape(shape_name, N, H, V, cases, comps, device, args):
    t0 = time.perf_counter()
    print(f"\n== {shape_name}: N={N} H={H} V={V} ==")
    h, W, y, g = make_inputs(N, H, V, device, logit_std=args.logit_std, seed=args.seed)
    want_loss = any(c in ("iii", "iv") for c in cases)
    ref = make_references(h, W, y, g, args.ref_rows, want_loss=want_loss)
    check_grpo_lce(h, W, y, g, ref, args.tol, args.chunk_size)
    bc.free_memory()

    base = {"shape": shape_name, "N": N, "H": H, "V": V}
    gemm_flops = 2 * N * H * V
    gemm = bc.time_ms(lambda: torch.mm(h, W.t()), device, warmup_ms=args.warmup_ms,
                      rep_ms=args.rep_ms, min_reps=args.min_reps)
    _, gemm_extra = bc.peak_extra_bytes(lambda: torch.mm(h, W.t()), device)
    floor = {**base, "gemm_ms": gemm["ms"], "gemm_p20": gemm["p20"], "gemm_p80": gemm["p80"],
             "gemm_extra_mib": None if gemm_extra is None else gemm_extra / 2**20,
             "gemm_tflops": gemm_flops / gemm["ms"] / 1e9}
    print(f"  floor: one GEMM X @ W.T {gemm['ms']:.2f} ms ({floor['gemm_tflops']:.0f} TFLOP/s);"
          f" 2x {2 * gemm['ms']:.2f}, 3x {3 * gemm['ms']:.2f}")
    print("  " + HEADER)

    rows = []
    accuracy = []
    if not args.no_accuracy:
        print(f"  accuracy vs fp64, no grad, first {min(args.ref_rows, N)} rows; floor = "
              "fp32-output GEMM + fp64 log-softmax:")
        peaked = make_inputs(N, H, V, device, logit_std=args.logit_std, seed=args.seed + 1,
                             peak_p=args.peak_p)[:3]
        for regime, (hh, WW, yy) in (("flat", (h, W, y)), ("peaked", peaked)):
            got = accuracy_rows(regime, hh, WW, yy, comps, device, args)
            print(f"  {regime}: median max p {got[0]['median_max_p']:.2e}, max |z| "
                  f"{got[0]['max_abs_logit']:.1f}")
            for r in got:
                print("    " + format_accuracy(r), flush=True)
            accuracy += [{**base, **r} for r in got]
        del peaked
        bc.free_memory()

    for case in cases:
        k = CASES[case][1]
        for comp in comps:
            row = {**base, "case": case, "competitor": comp.name, "call": comp.call,
                   "note": comp.notes.get(case, "")}
            reason = skip_reason(comp, case, N, V, device, args)
            if reason is None:
                try:
                    row.update(run_one(comp, case, h, W, y, g, ref, device, args))
                    row["status"] = "ok"
                except Unsupported as exc:
                    reason = f"n/a: {exc}"
                except Exception as exc:  # noqa: BLE001 - OOM or a competitor's own failure
                    reason = bc.short_error(exc)
            if reason is not None:
                row.update(status="n/a", reason=reason)
            bc.free_memory()
            if row["status"] == "ok":
                row["x_floor"] = row["ms"] / (k * gemm["ms"])
                row["tflops"] = k * gemm_flops / row["ms"] / 1e9
            rows.append(row)
            print("  " + format_row(row), flush=True)
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # drop the compiled graphs of this shape
    bc.free_memory()
    print(f"  ({time.perf_counter() - t0:.0f} s)")
    return floor, rows, accuracy


def summarize(floors, rows):
    """grpo_lce against the floor (k GEMMs) and against TRL, per shape and case."""
    out = []
    by = {(r["shape"], r["case"], r["competitor"]): r for r in rows if r["status"] == "ok"}
    for fl in floors:
        for case, (_, k) in CASES.items():
            ours = by.get((fl["shape"], case, "grpo_lce"))
            if ours is None:
                continue
            trl = by.get((fl["shape"], case, "trl"))
            out.append({
                "shape": fl["shape"], "case": case, "floor_gemms": k,
                "grpo_lce_ms": ours["ms"], "floor_ms": k * fl["gemm_ms"],
                "grpo_lce_over_floor": ours["ms"] / (k * fl["gemm_ms"]),
                "paired_over_floor": ours.get("paired_x_floor"),
                "paired_rounds": ours.get("paired_x_floor_rounds"),
                "trl_ms": trl["ms"] if trl else None,
                "grpo_lce_over_trl": ours["ms"] / trl["ms"] if trl else None,
                "grpo_lce_extra_mib": ours["extra_mib"],
                "trl_extra_mib": trl["extra_mib"] if trl else None,
            })
    return out


# ------------------------------------------------------------------------------- output


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


HEADER = (f"{'case':<4} {'competitor':<9} {'ms':>9} {'p20-p80':>17} {'xfloor':>6} {'TFLOP/s':>7} "
          f"{'extraMiB':>9} {'logp err':>8} {'ent err':>8} {'dh rel':>8} {'loss err':>8}  note")


def format_row(r):
    if r["status"] != "ok":
        return f"{r['case']:<4} {r['competitor']:<9} {'n/a':>9}  {r['reason']}"
    return (
        f"{r['case']:<4} {r['competitor']:<9} {r['ms']:9.2f} {r['p20']:8.2f}-{r['p80']:<8.2f} "
        f"{r['x_floor']:6.2f} {r['tflops']:7.1f} {_f(r['extra_mib'], '9.0f'):>9} "
        f"{_f(r['logp_err'], '8.1e'):>8} {_f(r['ent_err'], '8.1e'):>8} "
        f"{_f(r['dh_rel_err'], '8.1e'):>8} {_f(r['loss_err'], '8.1e'):>8}  {r['note']}"
    )


def markdown(meta, floors, rows, summary, accuracy=()):
    hw = meta["env"]["gpu"] or f"CPU ({meta['env']['cpu_threads']} threads)"
    e = meta["env"]
    lines = [
        f"# bench_head on {hw}",
        "",
        f"commit {e.get('commit')}; torch {e['torch']}, triton {e['triton']}, CUDA {e['cuda']}, "
        f"{e['date']}; "
        f"competitors: {', '.join(f'{k} {v}' for k, v in meta['packages'].items())}.",
        f"bf16 inputs, logits std {meta['args']['logit_std']}, targets sampled from the softmax; "
        f"errors vs fp64 on the first {meta['args']['ref_rows']} rows (dh: max error / max |dh|); "
        "ms = median, p20-p80 spread; extra MiB = peak above the inputs, returned grads included; "
        "x floor = ms / (k x one cuBLAS GEMM), k = 2, 1, 3, 2 for cases i-iv.",
        "",
        "Cases: " + "; ".join(f"({c}) {d}" for c, (d, _) in CASES.items()) + ".",
    ]
    for fl in floors:
        lines += [
            "",
            f"## {fl['shape']}: N={fl['N']} H={fl['H']} V={fl['V']}",
            "",
            f"Floor: one GEMM X @ Wᵀ {fl['gemm_ms']:.2f} ms ({fl['gemm_tflops']:.0f} TFLOP/s); "
            f"2x {2 * fl['gemm_ms']:.2f} ms, 3x {3 * fl['gemm_ms']:.2f} ms.",
            "",
            "| case | competitor | ms | p20-p80 | x floor | extra MiB | logp err | entropy err "
            "| dh rel err | loss err | note |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            if r["shape"] != fl["shape"]:
                continue
            if r["status"] != "ok":
                lines.append(
                    f"| {r['case']} | {r['competitor']} | n/a | | | | | | | | {r['reason']} |"
                )
                continue
            lines.append(
                f"| {r['case']} | {r['competitor']} | {r['ms']:.2f} "
                f"| {r['p20']:.2f}-{r['p80']:.2f} "
                f"| {r['x_floor']:.2f} | {_f(r['extra_mib'], '.0f')} | {_f(r['logp_err'], '.1e')} "
                f"| {_f(r['ent_err'], '.1e')} | {_f(r['dh_rel_err'], '.1e')} "
                f"| {_f(r['loss_err'], '.1e')} | {r['note']} |"
            )
    if summary:
        lines += [
            "",
            "## grpo_lce against the floor and TRL",
            "",
            "grpo_lce / floor: against the shape's floor row (timed first); paired: the median "
            "over rounds that time the floor and grpo_lce back to back (`paired_rounds`), with "
            "the rounds' range.",
            "",
            "| shape | case | grpo_lce ms | floor (k GEMMs) ms | grpo_lce / floor | paired "
            "| paired range | TRL ms | grpo_lce / TRL | grpo_lce MiB | TRL MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in summary:
            rng = s["paired_rounds"]
            lines.append(
                f"| {s['shape']} | {s['case']} | {s['grpo_lce_ms']:.2f} | {s['floor_ms']:.2f} "
                f"({s['floor_gemms']}) | {s['grpo_lce_over_floor']:.2f} "
                f"| {_f(s['paired_over_floor'], '.3f')} "
                f"| {f'{min(rng):.3f}-{max(rng):.3f}' if rng else '-'} "
                f"| {_f(s['trl_ms'], '.2f')} "
                f"| {_f(s['grpo_lce_over_trl'], '.2f')} | {_f(s['grpo_lce_extra_mib'], '.0f')} "
                f"| {_f(s['trl_extra_mib'], '.0f')} |"
            )
    if accuracy:
        lines += [
            "",
            "## Accuracy: flat and peaked logits",
            "",
            "No grad, max |error| vs fp64 over the first rows. Floor: a GEMM with fp32 output on "
            "the same bf16 inputs, then an fp64 log-softmax (`accuracy_rows`); x floor = the "
            "competitor's logp error / the floor's.",
            "",
            "| shape | regime | median max p | max abs z | competitor | logp err | x floor "
            "| floor logp err | entropy err | floor entropy err |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in accuracy:
            head = (f"| {r['shape']} | {r['regime']} | {r['median_max_p']:.2g} "
                    f"| {r['max_abs_logit']:.1f} | {r['competitor']} ")
            if r["status"] != "ok":
                lines.append(head + f"| n/a | | | | {r['reason']} |")
                continue
            lines.append(head + f"| {r['logp_err']:.1e} | {_f(r['logp_x_floor'], '.2f')} "
                         f"| {r['floor_logp_err']:.1e} | {_f(r['ent_err'], '.1e')} "
                         f"| {r['floor_ent_err']:.1e} |")
    lines += ["", "Calls:", ""]
    lines += [f"- {name}: `{call}`" for name, call in meta["calls"].items()]
    return "\n".join(lines) + "\n"


def plot(path, floor, rows, comps):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return None
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    colors = {name: f"C{i}" for i, name in enumerate(COMPETITORS)}  # same color in every run
    names = [c.name for c in comps if any(r["competitor"] == c.name and r["status"] == "ok"
                                         for r in rows)]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(2.2 * len(cases) + 3, 4.5))
    for j, name in enumerate(names):
        xs, ms = [], []
        for i, case in enumerate(cases):
            r = next((r for r in rows if r["case"] == case and r["competitor"] == name), None)
            if r and r["status"] == "ok":
                xs.append(i - 0.4 + (j + 0.5) * width)
                ms.append(r["ms"])
        ax.bar(xs, ms, width, label=name, color=colors[name])
    for i, case in enumerate(cases):
        k = CASES[case][1]
        ax.hlines(k * floor["gemm_ms"], i - 0.45, i + 0.45, colors="k", linestyles="--",
                  label="floor: k x GEMM" if i == 0 else None)
    ax.set_xticks(range(len(cases)), [f"({c}) {CASES[c][0]}" for c in cases], fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"LM head, {floor['shape']}: N={floor['N']} H={floor['H']} V={floor['V']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_shapes(spec, quick):
    if quick:
        return dict(QUICK_SHAPE)
    shapes = {}
    for name in spec.split(","):
        name = name.strip()
        if name in SHAPES:
            shapes[name] = SHAPES[name]
        elif name.count("x") == 2:  # NxHxV
            shapes[name] = tuple(int(v) for v in name.split("x"))
        else:
            raise SystemExit(f"--shapes: unknown shape {name!r}; known {list(SHAPES)} or NxHxV")
    return shapes


def parse_list(spec, known, flag):
    items = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in items if s not in known]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; known {list(known)}")
    return items


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma list of {list(SHAPES)} or NxHxV (default: all)")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of i,ii,iii,iv")
    p.add_argument("--competitors", default=",".join(COMPETITORS),
                   help=f"comma list of {list(COMPETITORS)} (the GEMM floor always runs)")
    p.add_argument("--quick", action="store_true", help=f"one small smoke shape {QUICK_SHAPE}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu")
    p.add_argument("--warmup-ms", type=float, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep-ms", type=float, default=100,
                   help="do_bench rep (ms), raised to fit min-reps")
    p.add_argument("--min-reps", type=int, default=5, help="at least this many timed calls")
    p.add_argument("--paired-rounds", type=int, default=5,
                   help="rounds of floor-then-grpo_lce timings for the paired ratio (0: none)")
    p.add_argument("--ref-rows", type=int, default=256, help="rows compared against fp64")
    p.add_argument("--logit-std", type=float, default=1.0, help="std of the random logits")
    p.add_argument("--peak-p", type=float, default=0.4,
                   help="median max p of the peaked accuracy regime (default 0.4)")
    p.add_argument("--no-accuracy", action="store_true",
                   help="skip the flat/peaked accuracy columns (timing only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-3, help="abort if grpo_lce logp err exceeds")
    p.add_argument("--eager-max-gib", type=float, default=40,
                   help="skip torch eager where its logits-sized tensors would exceed this")
    p.add_argument("--chunk-size", type=int, default=None, help="grpo_lce chunk_size (rows)")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args()

    if not 0 < args.peak_p < 1:
        raise SystemExit(f"--peak-p must be in (0, 1), got {args.peak_p}")
    if args.ref_rows <= 0:
        raise SystemExit(f"--ref-rows must be positive, got {args.ref_rows}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --device cpu")
    shapes = parse_shapes(args.shapes, args.quick)
    cases = parse_list(args.cases, CASES, "--cases")
    names = parse_list(args.competitors, COMPETITORS, "--competitors")

    # every (shape, case) compiles its own graph; keep Dynamo from falling back to eager
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)

    comps = build_competitors(names, args.chunk_size)
    env = bc.env_info(device)
    packages = {n: bc.package_version(n) for n in
                ("trl", "liger-kernel", "cut-cross-entropy", "transformers")}
    packages["grpo_lce"] = grpo_lce.__version__
    print(f"device {env['gpu'] or env['device']}; torch {env['torch']}, triton {env['triton']}, "
          f"CUDA {env['cuda']}; {packages}")
    for c in comps:
        print(f"  {c.name:<9} {c.unavailable or c.call}")

    t0 = time.perf_counter()
    floors, rows, accuracy = [], [], []
    for name, (N, H, V) in shapes.items():
        floor, shape_rows, shape_accuracy = bench_shape(name, N, H, V, cases, comps, device, args)
        floors.append(floor)
        rows += shape_rows
        accuracy += shape_accuracy
    summary = summarize(floors, rows)
    wall = time.perf_counter() - t0

    print("\n== summary: grpo_lce / floor (k GEMMs) and / TRL ==")
    for s in summary:
        print(f"  {s['shape']:<10} ({s['case']:<3}) grpo_lce {s['grpo_lce_ms']:8.2f} ms = "
              f"{s['grpo_lce_over_floor']:.2f} x floor "
              f"({s['floor_gemms']} GEMMs {s['floor_ms']:.2f} ms), paired "
              f"{_f(s['paired_over_floor'], '.3f')}"
              f"; / TRL {_f(s['grpo_lce_over_trl'], '.2f')}")
    for r in accuracy:
        if r["competitor"] == "grpo_lce" and r["status"] == "ok":
            print(f"  {r['shape']:<10} {r['regime']:<7} grpo_lce logp err {r['logp_err']:.1e} = "
                  f"{_f(r['logp_x_floor'], '.2f')} x floor {r['floor_logp_err']:.1e} "
                  f"(median max p {r['median_max_p']:.2f})")
    print(f"total {wall:.0f} s")

    meta = {
        "env": env,
        "packages": packages,
        "args": vars(args),
        "argv": sys.argv,
        "wall_s": wall,
        "cases": {c: {"what": d, "floor_gemms": k} for c, (d, k) in CASES.items()},
        "calls": {c.name: c.unavailable or c.call for c in comps},
    }
    out_dir = Path(args.out_dir)
    stem = f"bench_head_{bc.gpu_short_name(device)}{'_quick' if args.quick else ''}"
    bc.write_json(out_dir / f"{stem}.json", {"meta": meta, "floors": floors, "rows": rows,
                                             "summary": summary, "accuracy": accuracy})
    (out_dir / f"{stem}.md").write_text(markdown(meta, floors, rows, summary, accuracy))
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    if not args.no_plot and floors:
        first = floors[0]
        png = plot(out_dir / f"{stem}.png", first,
                   [r for r in rows if r["shape"] == first["shape"]], comps)
        if png:
            written.append(png)
    print("wrote " + ", ".join(str(w) for w in written))


if __name__ == "__main__":
    main()
