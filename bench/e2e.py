"""End-to-end benchmark: grpo_lce's TRL trainers against stock TRL 1.16, TRL 1.13 (the last release
that builds logits), plain transformers and Liger, on Llama-shaped QLoRA models.

Models (random init, built once on the GPU in bf16 and cached under --model-cache), loaded in
4-bit NF4 (double quant, bf16 compute), LoRA r=16 on every linear layer, gradient checkpointing
(non-reentrant), SDPA attention:

    1b   Llama-3.2-1B shape: hidden 2048, 16 layers, 32/8 heads, intermediate 8192, V 128256, tied
    8b   Llama-3.1-8B shape: hidden 4096, 32 layers, 32/8 heads, intermediate 14336, V 128256

Parts (--parts):

    grpo       GRPO training phase on a built batch (no generation): the reference pass
               (`_get_per_token_logps_and_entropies` under `use_adapter(model, None)`, no grad),
               then `compute_loss` + `backward` (β = 0.04, loss_type "dapo"). G sequences of a
               64-token prompt and completions of ⌈L·(i+1)/G⌉ tokens (shuffled, right-padded to
               L: 56 % mean fill at G=8). Sweeps L at G=--base-batch and G at L=--base-length.
               Systems: ours (trainers.GRPOTrainer, default packing="auto": packed through
               varlen attention under SDPA), ours_padded (packing=False), ours_packed (packed
               under flex_attention), trl116, trl113 (stock trl.GRPOTrainer).
    fit        the longest L (G=8) whose peak total memory (model + phase peak + AdamW state of
               the LoRA parameters) fits in 24 GiB and in 80 GiB: doubling grid, then --fit-bisect
               halvings. Computed from measured peaks; memory is not capped (on an 80 GB GPU an
               OOM counts as "does not fit 80 GiB").
    sft        SFT training phase (`compute_loss` + `backward`) on B full sequences of T tokens,
               every token a label; tokens/s and peak memory. Sweeps T at B=--sft-base-batch and
               B at T=--sft-base-length. Systems: ours (trainers.SFTTrainer), trl116
               (trl.SFTTrainer), hf (transformers.Trainer.compute_loss, i.e. `model(input_ids,
               labels=labels).loss` with full logits), liger (the same with Liger's fused linear
               cross-entropy: TRL 1.16 refuses `use_liger_kernel` with fused_linear_cross_entropy,
               so `apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, rope=False,
               rms_norm=False, swiglu=False)` patches LlamaForCausalLM.forward in its own process;
               only the head differs from hf).
    lossmatch  real `trainer.train()` for ours and stock TRL 1.16 with the same seed and data, on
               the 1b shape in bf16 (no quantization, LoRA r=16): SFT (copy-task rows of 256
               tokens, batch 4), the same SFT with an fp32 model, and GRPO (8 generations of 64
               sampled tokens per prompt, reward = share of completion tokens in the lower half
               of the vocabulary). Per-step loss and grad-norm tables. GRPO generations are
               sampled with the same seed; a hash of each step's completion ids shows where the
               two runs start sampling different tokens (after the first update the weights
               differ at bf16 noise level, so sampling may diverge).

Each (part, model, system) runs in its own worker process (`--worker`), which writes one JSON
line per measurement as soon as it has it; the driver launches the workers, stops starting new
ones after --budget-min, and then writes the tables, plots and JSON from all lines so far. TRL
1.13 and 1.16 cannot share a process, so unlike the kernel benchmark (bench/head.py), the systems
here are compared across processes, one at a time on the same GPU. A system that is not
installed is recorded as "n/a: not installed"; an out-of-memory point as OOM (larger points of the
same sweep are then skipped as OOM).

Timing: torch.cuda.synchronize + perf_counter around one call, one warm-up call, then the median
of --reps calls (one call once a warm-up takes over 30 s). Memory: torch.cuda.max_memory_allocated
during one call, minus what was allocated just before it (the loaded model, LoRA and the batch):
"extra"; "total" is the absolute peak, model included.

GPU (from the project root; `.whl/` from ../shared/gpu/wheels.sh and `.whl113/` holding
trl-1.13.0-py3-none-any.whl, both carried). Quick run (1b; grpo L 1024/4096, sft T 1024/4096,
lossmatch 10 SFT + 5 GRPO steps; ~6 min on an H200):

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; python3 -m pip install -q --no-index --no-deps --target /tmp/site113 .whl113/trl-1.13.0-py3-none-any.whl; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; python3 -m bench.e2e --quick --budget-min 8.5

Full run, one 10-minute call per line, each adding to the same results (--resume):

    python3 -m bench.e2e --models 1b --parts grpo --resume --budget-min 8.5
    python3 -m bench.e2e --models 1b --parts sft --resume --budget-min 8.5
    python3 -m bench.e2e --models 1b --parts fit --resume --budget-min 8.5
    python3 -m bench.e2e --models 1b --parts lossmatch --resume --budget-min 8.5
    python3 -m bench.e2e --models 8b --parts grpo --systems ours,trl116,trl113 --reps 2 --resume --budget-min 8.5

(the committed 8b run: --lengths 512,1024,2048,4096,8192,16384 --batches 8,16,32 over three
calls; its fit table is read off that grid). `--report-only H200` rewrites the tables, plots
and JSON from e2e_H200.jsonl without running anything.

(repeat a line until its part is complete: finished points are skipped on --resume).

CPU smoke run (tiny offline Llama, no 4-bit, two lengths, 2 loss-match steps):

    python3 -m bench.e2e --tiny --device cpu

Writes to --out-dir (default bench/results): e2e_<GPU>[_quick|_tiny].jsonl (raw lines),
.json (all records + environment per system), .md (tables) and _grpo_<model>.png /
_sft_<model>.png (memory and speed against length and batch, one line per system).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import common as bc
from bench import e2e_common as E
from bench import workers as W

GRPO_SYSTEMS = ("ours", "ours_padded", "ours_packed", "trl116", "trl113")
# ours: the default packing="auto", which under sdpa on CUDA packs through torch's varlen
# FlashAttention (trainers.attention); ours_padded: packing=False; ours_packed: packing=True under
# flex_attention. Every model is loaded with sdpa except ours_packed's.
ATTN = {"ours_packed": "flex_attention"}
GRPO_PACKING = {"ours": "auto", "ours_padded": False, "ours_packed": True}
SFT_SYSTEMS = ("ours", "trl116", "hf", "liger")
# ours_eager_gen: trainers.GRPOTrainer with fast_generation=False (TRL's own sampling)
LOSSMATCH_SYSTEMS = ("ours", "ours_eager_gen", "trl116")
LOSSMATCH_VARIANTS = ("sft-bf16", "sft-fp32", "grpo-bf16")
PARTS = ("grpo", "fit", "sft", "lossmatch")
SYSTEM_LABEL = {
    "ours": "grpo_lce", "ours_padded": "grpo_lce padded", "ours_packed": "grpo_lce packed (flex)",
    "ours_eager_gen": "grpo_lce, TRL's sampling", "trl116": "TRL 1.16",
    "trl113": "TRL 1.13", "hf": "transformers", "liger": "Liger FLCE",
}

# Grids: full, --quick, --tiny. Lengths are completion tokens (GRPO) or sequence tokens (SFT).
GRIDS = {
    "full": dict(
        lengths=[512, 1024, 2048, 4096, 8192, 16384], batches=[8, 16, 32], base_batch=8,
        base_length=1024, sft_lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768],
        sft_batches=[1, 2, 4, 8, 16, 32, 64], sft_base_batch=4, sft_base_length=1024,
        fit_lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768], fit_bisect=2,
        lm_sft_steps=50, lm_grpo_steps=20, lm_sft_length=256, lm_completion=64, lm_gens=8,
        reps=3,
    ),
    "quick": dict(
        lengths=[1024, 4096], batches=[8], base_batch=8, base_length=1024,
        sft_lengths=[1024, 4096], sft_batches=[4], sft_base_batch=4, sft_base_length=1024,
        fit_lengths=[1024, 2048, 4096, 8192, 16384, 32768], fit_bisect=0,
        lm_sft_steps=10, lm_grpo_steps=5, lm_sft_length=256, lm_completion=64, lm_gens=8,
        reps=2,
    ),
    "tiny": dict(
        lengths=[16, 32], batches=[4, 8], base_batch=4, base_length=16,
        sft_lengths=[32, 64], sft_batches=[2, 4], sft_base_batch=2, sft_base_length=32,
        fit_lengths=[16, 32, 64], fit_bisect=1,
        lm_sft_steps=2, lm_grpo_steps=2, lm_sft_length=32, lm_completion=8, lm_gens=4, reps=2,
    ),
}
DEFAULT_PARTS = {"full": "grpo,sft", "quick": "grpo,sft,lossmatch", "tiny": ",".join(PARTS)}


# =========================================================================== worker


def task_row(part: str, task: dict, status: str) -> dict:
    """The record of a task that did not run, saying why (a fit task's is its summary)."""
    return {**task, "status": status, **({"kind": "summary"} if part == "fit" else {})}


def worker_env(device: str) -> dict:
    info = W.worker_env(device)
    import trl  # the version this process imports, which is what PYTHONPATH picked

    info["trl"] = trl.__version__
    info["trl_path"] = os.path.dirname(trl.__file__)
    return info


def unavailable(system: str, device: str) -> str | None:
    """Why `system` cannot run in this process, or None."""
    import trl

    v = trl.__version__
    if system in (*GRPO_PACKING, "ours_eager_gen", "trl116", "hf", "liger") \
            and not v.startswith("1.16"):
        return f"n/a: needs TRL 1.16, this process imports {v}"
    if system == "trl113" and not v.startswith("1.13"):
        return f"n/a: not installed (TRL 1.13 not on PYTHONPATH, this process imports {v})"
    if system == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "n/a: not installed (liger-kernel)"
        if device != "cuda":
            return "n/a: Liger's Triton kernels need CUDA"
    return None


def grpo_trainer_cls(system: str):
    if system in GRPO_PACKING or system == "ours_eager_gen":
        from trainers import GRPOTrainer

        return GRPOTrainer
    import trl

    return trl.GRPOTrainer


def sft_trainer_cls(system: str):
    if system == "ours":
        from trainers import SFTTrainer

        return SFTTrainer
    import trl

    return trl.SFTTrainer


def base_args(out: str, device: str, *, bs: int, bf16: bool, checkpointing: bool = True,
              seed: int = 0) -> dict:
    return dict(
        output_dir=out, report_to="none", save_strategy="no", logging_steps=1, seed=seed,
        per_device_train_batch_size=bs, bf16=bf16 and device == "cuda",
        use_cpu=device == "cpu", **E.checkpointing_kw(checkpointing),
    )


def zero_reward(completions, **kw):
    return [0.0] * len(completions)


def build_grpo(system, model, tok, *, G, L, device, out, **extra):
    import trl
    from datasets import Dataset

    args = trl.GRPOConfig(
        **base_args(out, device, bs=G, bf16=True), num_generations=G, max_completion_length=L,
        beta=0.04, loss_type="dapo", **extra)
    ds = Dataset.from_dict({"prompt": ["hello"] * G})
    trainer_kw = {"packing": GRPO_PACKING[system]} if system in GRPO_PACKING else {}
    return grpo_trainer_cls(system)(
        **trainer_kw,
        model=model, reward_funcs=zero_reward, args=args, train_dataset=ds, processing_class=tok,
        peft_config=E.lora_config())


def build_sft(system, model, tok, *, B, device, out):
    """A trainer whose compute_loss is the system's SFT loss. hf / liger: transformers.Trainer
    over a PEFT model prepared as TRL 1.16 prepares it (LoRA, input grads, bf16 QLoRA adapters)."""
    import torch

    if system in ("ours", "trl116"):
        import trl
        from datasets import Dataset

        args = trl.SFTConfig(**base_args(out, device, bs=B, bf16=True), max_length=None)
        ds = Dataset.from_dict({"prompt": ["hi"] * B, "completion": [" there"] * B})
        return sft_trainer_cls(system)(
            model=model, args=args, train_dataset=ds, processing_class=tok,
            peft_config=E.lora_config())
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    quantized = getattr(model, "is_loaded_in_4bit", False)
    model = get_peft_model(model, E.lora_config())
    model.enable_input_require_grads()
    if quantized:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    args = TrainingArguments(**base_args(out, device, bs=B, bf16=True))
    return Trainer(model=model, args=args, processing_class=tok)


def loss_step(tr, inputs):
    """One training-phase call as `training_step` runs it: loss forward + backward."""
    def run():
        with tr.compute_loss_context_manager():
            loss = tr.compute_loss(tr.model, dict(inputs))
        loss.backward()
        tr.model.zero_grad(set_to_none=True)
        return loss.detach().float().item()
    return run


def timed_phases(phases: dict, device: str, reps: int, warmup: bool = True) -> dict:
    """{phase: summary} over `reps` rounds of calling each phase in order, after one warm-up
    round. `phases` maps name -> zero-arg fn; a fn may read results of earlier phases."""
    rounds = []
    if warmup:
        t0 = time.perf_counter()
        for fn in phases.values():
            fn()
        if time.perf_counter() - t0 > 30:
            reps = 1
    for _ in range(reps):
        rounds.append({name: E.measured_call(fn, device) for name, fn in phases.items()})
    out = {name: E.summarize([r[name][1:] for r in rounds]) for name in phases}
    out["_results"] = {name: rounds[-1][name][0] for name in phases}
    return out


def grpo_point(tr, *, G, L, V, device, reps, warmup=True) -> dict:
    import torch
    from trl.trainer.utils import use_adapter

    ids, mask = E.grpo_batch(G, L, V, device)
    P = E.PROMPT_LEN
    state: dict = {}

    def ref():
        with torch.no_grad(), use_adapter(tr.model, None):
            state["ref"] = tr._get_per_token_logps_and_entropies(
                tr.model, ids, mask, L, batch_size=G)[0]
        return state["ref"]

    g = torch.Generator().manual_seed(1)
    adv = torch.randn(G, generator=g).to(device)

    def loss():
        inputs = {
            "prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P],
            "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
            "advantages": adv, "num_items_in_batch": mask[:, P:].sum(),
            "ref_per_token_logps": state["ref"],
        }
        return loss_step(tr, inputs)()

    r = timed_phases({"ref": ref, "loss": loss}, device, reps, warmup)
    valid = mask[:, P:].bool()
    # how the log-prob passes ran: "sdpa_varlen" / "block" packed, None padded (ours only)
    kind = tr._lce_packing_kind(tr.model, False) if hasattr(tr, "_lce_packing_kind") else None
    return {"ref": r["ref"], "loss": r["loss"], "loss_value": r["_results"]["loss"],
            "ref_logp_mean": float(state["ref"][valid].float().mean()),
            "tokens": int(mask.sum()), "packing_kind": kind}


def sft_point(tr, *, B, T, V, device, reps) -> dict:
    inputs = E.sft_batch(B, T, V, device)
    r = timed_phases({"step": loss_step(tr, inputs)}, device, reps)
    return {"step": r["step"], "loss_value": r["_results"]["step"],
            "tokens_per_s": B * T / (r["step"]["ms"] / 1e3)}


def dominated(oomed: list[tuple[int, int]], a: int, b: int) -> tuple[int, int] | None:
    """The first OOMed (length, batch) at or below (a, b): a larger point OOMs too."""
    return next(((x, y) for x, y in oomed if x <= a and y <= b), None)


def run_sweep(sink, tasks, deadline, measure, dims):
    """Measure each task in order; OOM -> record, skip the tasks it dominates."""
    import torch

    oomed: list[tuple[int, int]] = []
    for t in tasks:
        if time.time() > deadline:
            print(f"  budget reached, {t['key']} and later not started", flush=True)
            return
        a, b = t[dims[0]], t[dims[1]]
        d = dominated(oomed, a, b)
        if d is not None:
            sink.write({"key": t["key"], **{k: t[k] for k in dims},
                        "status": "OOM",
                        "note": f"skipped: {dims[0]}={d[0]} {dims[1]}={d[1]} OOMed"})
            continue
        try:
            rec = {"status": "ok", **measure(t)}
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            if not E.is_oom(exc):
                import traceback

                traceback.print_exc()
            err = f"error: {type(exc).__name__}: {exc}"[:300]
            rec = {"status": "OOM" if E.is_oom(exc) else err}
            if E.is_oom(exc):
                oomed.append((a, b))
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            E.free()
        sink.write({"key": t["key"], **{k: t[k] for k in dims}, **rec})
        print(f"  {t['key']}: {fmt_point(rec)}", flush=True)


def fmt_point(rec: dict) -> str:
    if rec.get("status") != "ok":
        return rec.get("status", "?")
    parts = []
    for ph in ("ref", "loss", "step"):
        if ph in rec:
            s = rec[ph]
            mem = "" if s["extra_bytes"] is None else f" {s['extra_bytes'] / E.GIB:.2f} GiB"
            parts.append(f"{ph} {s['ms']:.1f} ms{mem}")
    if "tokens_per_s" in rec:
        parts.append(f"{rec['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def worker_grpo(a, sink, tasks, deadline, path, tok, out):
    import torch

    model = E.load_model(path, device=a.device, quantize=a.quantize,
                         attn=ATTN.get(a.system, "sdpa"))
    V = model.config.vocab_size
    tr = build_grpo(a.system, model, tok, G=tasks[0]["G"], L=tasks[0]["L"], device=a.device,
                    out=out)
    E.prepare_for_direct_calls(tr, checkpointing=True)
    E.free()
    model_bytes = torch.cuda.memory_allocated() if a.device == "cuda" else None
    opt = E.optimizer_state_bytes(tr.model)
    sink.base.update(model_bytes=model_bytes, opt_bytes=opt, trainable=E.trainable_params(tr.model))
    run_sweep(sink, tasks, deadline, lambda t: grpo_point(
        tr, G=t["G"], L=t["L"], V=V, device=a.device, reps=a.reps), ("L", "G"))


def worker_fit(a, sink, task, deadline, path, tok, out):
    """Doubling search, then bisection per budget, of the longest L at G whose total peak fits."""
    import torch

    model = E.load_model(path, device=a.device, quantize=a.quantize,
                         attn=ATTN.get(a.system, "sdpa"))
    V, G = model.config.vocab_size, task["G"]
    tr = build_grpo(a.system, model, tok, G=G, L=task["lengths"][0], device=a.device, out=out)
    E.prepare_for_direct_calls(tr, checkpointing=True)
    E.free()
    cuda = a.device == "cuda"
    model_bytes = torch.cuda.memory_allocated() if cuda else None
    opt = E.optimizer_state_bytes(tr.model)
    sink.base.update(model_bytes=model_bytes, opt_bytes=opt)
    budgets = [b * E.GIB for b in task["budgets"]]
    total: dict[int, float] = {}  # L -> peak total bytes incl. AdamW state; inf = OOM
    warm = [True]

    def measure(L):
        if time.time() > deadline:
            raise TimeoutError
        try:
            r = grpo_point(tr, G=G, L=L, V=V, device=a.device, reps=1, warmup=warm[0])
            warm[0] = False
            peak = max(r["ref"]["total_bytes"] or 0, r["loss"]["total_bytes"] or 0)
            total[L] = peak + opt if cuda else float("nan")
            rec = {"status": "ok", **r, "total_bytes": total[L]}
        except Exception as exc:  # noqa: BLE001
            if not E.is_oom(exc):
                raise
            total[L] = float("inf")
            rec = {"status": "OOM"}
        finally:
            E.free()
        sink.write({"key": f"{task['key']}|L={L}", "kind": "point", "L": L, "G": G, **rec})
        print(f"  fit L={L}: {fmt_point(rec)}", flush=True)

    stop = ""
    try:
        for L in task["lengths"]:
            measure(L)
            if not total[L] <= max(budgets):  # over the largest budget, OOM (or nan on CPU)
                break
        for b in budgets:
            for _ in range(task["bisect"]):
                lo = max((L for L, v in total.items() if v <= b), default=None)
                hi = min((L for L, v in total.items() if not v <= b), default=None)
                if lo is None or hi is None:
                    break
                step = max(8, 2 ** max(0, (hi - lo).bit_length() - 3))
                mid = (lo + hi) // 2 // step * step
                if mid <= lo or mid >= hi:
                    break
                measure(mid)
    except TimeoutError:
        stop = "budget reached before the search ended"
    summary = fit_summary(total, task["budgets"])
    status = "ok" if cuda else "n/a: needs CUDA memory statistics"
    sink.write({"key": task["key"], "kind": "summary", "G": G, "status": status,
                "summary": summary, "note": stop})


def fit_summary(total: dict, budgets_gib) -> list[dict]:
    """Per budget (GiB): the longest L whose peak total fits and the first longer L that does
    not, from {L: peak total bytes (inf = OOM)}."""
    summary = []
    for gib_ in budgets_gib:
        fits = [L for L, v in total.items() if v <= gib_ * E.GIB]
        over = [L for L, v in total.items() if not v <= gib_ * E.GIB]
        summary.append({
            "budget_gib": gib_, "max_L": max(fits) if fits else None,
            "first_over": min((L for L in over if not fits or L > max(fits)), default=None),
        })
    return summary


def worker_sft(a, sink, tasks, deadline, path, tok, out):
    import torch

    if a.system == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Class-level patch of LlamaForCausalLM.forward, fine in this process of its own. Only the
        # head changes; RoPE, RMSNorm and SwiGLU stay as in the other systems.
        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    model = E.load_model(path, device=a.device, quantize=a.quantize)
    V = model.config.vocab_size
    tr = build_sft(a.system, model, tok, B=tasks[0]["B"], device=a.device, out=out)
    E.prepare_for_direct_calls(tr, checkpointing=True)
    E.free()
    model_bytes = torch.cuda.memory_allocated() if a.device == "cuda" else None
    sink.base.update(model_bytes=model_bytes)
    run_sweep(sink, tasks, deadline, lambda t: sft_point(
        tr, B=t["B"], T=t["T"], V=V, device=a.device, reps=a.reps), ("T", "B"))


def worker_lossmatch(a, sink, task, path, tok, out):
    """One real trainer.train() run; per-step loss / grad_norm from the log history."""
    import torch
    import trl
    from datasets import Dataset

    variant, seed = task["variant"], task.get("seed", 0)
    fp32 = variant.endswith("fp32")
    dtype = torch.float32 if fp32 or a.device == "cpu" else torch.bfloat16
    model = E.load_model(path, device=a.device, quantize=False, dtype=dtype)
    V = model.config.vocab_size
    hashes: list[str] = []
    if variant.startswith("sft"):
        T, bs, n = task["length"], 4, task["steps"]
        ds = Dataset.from_dict({"input_ids": E.copy_task_ids(n * bs, T, V)})
        args = trl.SFTConfig(**base_args(out, a.device, bs=bs, bf16=not fp32, seed=seed),
                             max_steps=n,
                             learning_rate=1e-4, max_length=T)
        tr = sft_trainer_cls(a.system)(model=model, args=args, train_dataset=ds,
                                       processing_class=tok, peft_config=E.lora_config())
    else:
        G, n = task["gens"], task["steps"]

        def reward(completions, completion_ids, **kw):
            hashes.append(E.ids_hash(completion_ids))
            return [sum(t < V // 2 for t in c) / max(1, len(c)) for c in completion_ids]

        prompts = [f"Task {i}: write {i % 7} numbers." for i in range(n)]
        args = trl.GRPOConfig(
            **base_args(out, a.device, bs=G, bf16=True, seed=seed), num_generations=G,
            max_completion_length=task["completion"], beta=0.04, max_steps=n,
            learning_rate=5e-5, temperature=1.0)
        tr = grpo_trainer_cls(a.system)(
            model=model, reward_funcs=reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
            peft_config=E.lora_config(),
            **({"fast_generation": False} if a.system == "ours_eager_gen" else {}))
    t0 = time.perf_counter()
    tr.train()
    keep = ("loss", "grad_norm", "reward", "kl", "entropy", "mean_token_accuracy")
    steps = [{"step": h["step"], **{k: h[k] for k in keep if k in h}}
             for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
    sink.write({"key": task["key"], "variant": variant, "seed": seed, "status": "ok",
                "steps": steps,
                "completion_hashes": hashes, "seconds": time.perf_counter() - t0})
    print(f"  {task['key']}: {len(steps)} steps, last loss "
          f"{steps[-1]['loss'] if steps else float('nan'):.5f}", flush=True)


def worker_main(a) -> int:
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tasks = json.loads(a.tasks)
    sink = W.Sink(a.jsonl, part=a.part, model=a.model, system=a.system)
    why = unavailable(a.system, a.device)
    if why is not None:
        for t in tasks:
            sink.write(task_row(a.part, t, why))
        print(f"  [{a.system}] {why}", flush=True)
        return 0
    import torch

    torch.manual_seed(0)
    sink.write({"key": f"env|{a.part}|{a.model}|{a.system}", "part": "env",
                "env": worker_env(a.device), "status": "ok"})
    from transformers import AutoTokenizer

    path = E.model_dir(a.model, a.model_cache)
    tok = AutoTokenizer.from_pretrained(path)
    a.quantize = a.device == "cuda" and a.model != "tiny"
    with tempfile.TemporaryDirectory() as out:
        if a.part == "grpo":
            worker_grpo(a, sink, tasks, a.deadline, path, tok, out)
        elif a.part == "fit":
            worker_fit(a, sink, tasks[0], a.deadline, path, tok, out)
        elif a.part == "sft":
            worker_sft(a, sink, tasks, a.deadline, path, tok, out)
        else:
            for t in tasks:
                if time.time() > a.deadline:
                    break
                worker_lossmatch(a, sink, t, path, tok, out)
                E.free()
    return 0


# =========================================================================== driver


def plan(a, grid) -> list[dict]:
    """Worker jobs [{part, model, system, tasks}] in run order."""
    jobs = []
    for part in a.parts:
        systems = {"grpo": GRPO_SYSTEMS, "fit": GRPO_SYSTEMS, "sft": SFT_SYSTEMS,
                   "lossmatch": LOSSMATCH_SYSTEMS}[part]
        systems = [s for s in systems if s in a.systems]
        # the loss-match runs use the 1b shape only (the 8b one would be 2 x 16 GB in bf16)
        models = ["tiny"] if a.tiny else ["1b"] if part == "lossmatch" else a.models
        for model in models:
            for system in systems:
                pre = f"{part}|{model}|{system}"
                if part == "grpo":
                    pts = [(L, a.base_batch) for L in a.lengths] + [
                        (a.base_length, G) for G in a.batches]
                    pts = sorted(set(pts), key=lambda p: (p[1], p[0]))
                    tasks = [{"key": f"{pre}|L={L}|G={G}", "L": L, "G": G} for L, G in pts]
                elif part == "sft":
                    pts = [(T, a.sft_base_batch) for T in a.sft_lengths] + [
                        (a.sft_base_length, B) for B in a.sft_batches]
                    pts = sorted(set(pts), key=lambda p: (p[1], p[0]))
                    tasks = [{"key": f"{pre}|T={T}|B={B}", "T": T, "B": B} for T, B in pts]
                elif part == "fit":
                    tasks = [{"key": pre, "lengths": sorted(a.fit_lengths), "G": 8 if not a.tiny
                              else a.base_batch, "budgets": [24, 80], "bisect": a.fit_bisect}]
                else:
                    seed = "" if a.lossmatch_seed == 0 else f"|seed={a.lossmatch_seed}"
                    tasks = [dict(t, key=f"{pre}|{t['variant']}{seed}", seed=a.lossmatch_seed)
                             for t in (
                        {"variant": "sft-bf16", "steps": a.lm_sft_steps,
                         "length": a.lm_sft_length},
                        {"variant": "sft-fp32", "steps": a.lm_sft_steps,
                         "length": a.lm_sft_length},
                        {"variant": "grpo-bf16", "steps": a.lm_grpo_steps,
                         "completion": a.lm_completion, "gens": a.lm_gens},
                    ) if t["variant"] in a.lossmatch_variants
                        # TRL's sampling against fast generation: a GRPO question only
                        and (system != "ours_eager_gen" or t["variant"].startswith("grpo"))]
                jobs.append({"part": part, "model": model, "system": system, "tasks": tasks})
    return jobs


def latest(recs: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in recs:
        out[r["key"]] = r
    return out


def worker_env_vars(system: str, a) -> dict:
    """The worker's environment: TRL 1.13's directory first on PYTHONPATH for trl113 only."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.abspath(p) != os.path.abspath(a.trl113_path)]
    if system == "trl113":
        parts.insert(0, a.trl113_path)
    if str(W.ROOT) not in parts:
        parts.append(str(W.ROOT))
    return W.child_env(PYTHONPATH=os.pathsep.join(parts))


def run_job(job, a, jsonl: Path, deadline: float) -> None:
    """Run one worker (again, after a crash, for what is left) until its tasks are recorded."""
    done = {k for k, r in latest(bc.read_jsonl([jsonl])).items()
            if not str(r.get("status", "")).startswith("error")}
    todo = [t for t in job["tasks"] if t["key"] not in done]
    if not todo:
        return
    label = f"[{job['part']} {job['model']} {job['system']}]"
    sink = W.Sink(jsonl, part=job["part"], model=job["model"], system=job["system"])
    if job["system"] == "trl113" and not (Path(a.trl113_path) / "trl").is_dir():
        for t in todo:  # no process needed to say so
            sink.write(task_row(job["part"], t,
                                f"n/a: not installed (no trl in {a.trl113_path})"))
        print(f"{label} n/a: not installed", flush=True)
        return
    # an "error" status: --resume runs the task again
    killed = f"error: killed {a.grace_s:.0f} s after the budget"
    while todo and time.time() < deadline:
        print(f"{label} {len(todo)} task(s)", flush=True)
        argv = W.worker_argv("bench.e2e", a, ("device", "model_cache", "reps", "trl113_path"),
                             part=job["part"], model=job["model"], system=job["system"],
                             tasks=json.dumps(todo), jsonl=jsonl, deadline=deadline)
        run = W.run_worker(argv, jsonl, kill_at=deadline + a.grace_s, killed=killed,
                           env=worker_env_vars(job["system"], a))
        left = W.unrecorded(run, todo, key=lambda r: r.get("key"))
        if run.status is None or not left:
            return
        # a crash or kill, not an exception (which the worker records): blame the task it was on
        print(f"  {left[0]['key']}: {run.status}", flush=True)
        sink.write(task_row(job["part"], left[0], run.status))
        todo = [] if run.status == killed else left[1:]


# --------------------------------------------------------------------------- report


def gib(b) -> str:
    return "—" if b is None else f"{b / E.GIB:.2f}"


def cell(rec, fn) -> str:
    if rec is None:
        return "not run"
    if rec.get("status") != "ok":
        s = rec.get("status", "?")
        return "OOM" if s == "OOM" else s
    return fn(rec)


def _sweep_rows(recs: dict, part: str, dims: tuple[str, str], systems, blanks: int, cells):
    """Table rows of a length x batch sweep: per point and system, `cells(r)` or the status."""
    a, b = dims
    pts = sorted({(r["model"], r[a], r[b]) for r in recs.values()
                  if r.get("part") == part and a in r}, key=lambda p: (p[0], p[2], p[1]))
    rows = []
    for model, x, y in pts:
        for s in systems:
            r = recs.get(f"{part}|{model}|{s}|{a}={x}|{b}={y}")
            if r is not None:
                ok = r.get("status") == "ok"
                rows.append(f"| {model} | {x} | {y} | {SYSTEM_LABEL[s]} | "
                            + (cells(r, model) if ok else f"{cell(r, str)} |" + " |" * blanks))
    return rows


def grpo_table(recs: dict, models, systems) -> str:
    def cells(r, model):
        tot = max(r["ref"]["total_bytes"] or 0, r["loss"]["total_bytes"] or 0) or None
        base = recs.get(f"grpo|{model}|trl116|L={r['L']}|G={r['G']}")
        ratio = ""  # (ref + loss) time over TRL 1.16's at the same point
        if base is not None and base.get("status") == "ok":
            t = r["ref"]["ms"] + r["loss"]["ms"]
            ratio = f"{t / (base['ref']['ms'] + base['loss']['ms']):.2f}x"
        return (f"{r['ref']['ms']:.0f} | {gib(r['ref']['extra_bytes'])} | {r['loss']['ms']:.0f} | "
                f"{gib(r['loss']['extra_bytes'])} | {gib(tot)} | {ratio} | "
                f"{r['loss_value']:+.5f} |")

    return "\n".join(["| model | L | G | system | ref ms | ref extra GiB | loss ms | "
                      "loss extra GiB | peak total GiB | time vs TRL 1.16 | loss |",
                      "|---|---|---|---|---|---|---|---|---|---|---|",
                      *_sweep_rows(recs, "grpo", ("L", "G"), systems, 6, cells)])


def sft_table(recs: dict, models, systems) -> str:
    def cells(r, model):
        st = r["step"]
        return (f"{st['ms']:.0f} | {r['tokens_per_s']:.0f} | {gib(st['extra_bytes'])} | "
                f"{gib(st['total_bytes'])} | {r['loss_value']:.4f} |")

    return "\n".join(["| model | T | B | system | ms | tokens/s | extra GiB | peak total GiB "
                      "| loss |",
                      "|---|---|---|---|---|---|---|---|---|",
                      *_sweep_rows(recs, "sft", ("T", "B"), systems, 4, cells)])


def _fit_cells(summary: list[dict]) -> list[str]:
    """'L (< L_over)' per budget of a `fit_summary`."""
    return [("none" if s["max_L"] is None else str(s["max_L"]))
            + ("" if s["first_over"] is None else f" (< {s['first_over']})") for s in summary]


def fit_table(recs: dict) -> str:
    rows = ["| model | system | G | longest L ≤ 24 GiB | longest L ≤ 80 GiB | note |",
            "|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(GRPO_SYSTEMS)}
    summaries = sorted(
        (r for r in recs.values() if r.get("part") == "fit" and r.get("kind") == "summary"),
        key=lambda r: (r["model"], order.get(r["system"], 99)))
    for r in summaries:
        if r.get("status") != "ok":
            rows.append(f"| {r['model']} | {SYSTEM_LABEL[r['system']]} | {r.get('G', '')} | "
                        f"{r['status']} | | |")
            continue
        cells = _fit_cells(r["summary"])
        rows.append(f"| {r['model']} | {SYSTEM_LABEL[r['system']]} | {r['G']} | {cells[0]} | "
                    f"{cells[1]} | {r.get('note', '')} |")
    # Models without a fit search: the same quantity read off their G=8 GRPO grid (the grid's
    # lengths only, no bisection), from the same peak totals plus the AdamW state.
    searched = {r["model"] for r in summaries}
    grid = [r for r in recs.values() if r.get("part") == "grpo" and r.get("G") == 8
            and r["model"] not in searched and r.get("status") in ("ok", "OOM")]
    for model in sorted({r["model"] for r in grid}):
        for system in GRPO_SYSTEMS:
            pts = [r for r in grid if r["model"] == model and r["system"] == system]
            if not pts:
                continue
            total = {r["L"]: float("inf") if r["status"] == "OOM" else
                     max(r["ref"]["total_bytes"] or 0, r["loss"]["total_bytes"] or 0)
                     + (r.get("opt_bytes") or 0) for r in pts}
            cells = _fit_cells(fit_summary(total, (24, 80)))
            rows.append(f"| {model} | {SYSTEM_LABEL[system]} | 8 | {cells[0]} | {cells[1]} | "
                        f"from the GRPO grid (L = {', '.join(str(L) for L in sorted(total))}) |")
    return "\n".join(rows)


def lossmatch_tables(recs: dict) -> str:
    """Per-step tables of each grpo_lce loss-match run against stock TRL's run of the same
    variant, model and seed."""
    out = []
    runs = [r for r in recs.values() if r.get("part") == "lossmatch" and "variant" in r]
    for variant in LOSSMATCH_VARIANTS:
        for model, seed in sorted({(r["model"], r.get("seed", 0)) for r in runs
                                   if r["variant"] == variant}):
            suffix = "" if seed == 0 else f"|seed={seed}"
            t = recs.get(f"lossmatch|{model}|trl116|{variant}{suffix}")
            for ours in ("ours", "ours_eager_gen"):
                o = recs.get(f"lossmatch|{model}|{ours}|{variant}{suffix}")
                if o is None:
                    continue
                out.extend(lossmatch_table(o, t, f"{variant}, {model}, seed {seed}: "
                                                 f"{SYSTEM_LABEL[ours]} vs stock TRL 1.16"))
    return "\n".join(out)


def lossmatch_table(o: dict, t: dict | None, title: str) -> list[str]:
    """Lines of one run's per-step table against TRL's run `t` (same seed and data)."""
    out = [f"\n### {title}\n"]
    if not (t and o.get("status") == "ok" and t.get("status") == "ok"):
        out.append(f"ours: {o.get('status')}, TRL 1.16: {t and t.get('status')}")
        return out
    variant = o["variant"]
    grpo = variant.startswith("grpo")
    head = ("| step | loss ours | loss TRL | abs diff | grad-norm ours | grad-norm TRL | "
            "abs diff |" + (" same completions |" if grpo else ""))
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    ts = {s["step"]: s for s in t["steps"]}
    dl, dg = [], []
    for s in o["steps"]:
        u = ts.get(s["step"])
        if u is None:
            continue
        l1, l2 = s.get("loss"), u.get("loss")
        g1, g2 = s.get("grad_norm"), u.get("grad_norm")
        d1 = abs(l1 - l2) if None not in (l1, l2) else None
        d2 = abs(g1 - g2) if None not in (g1, g2) else None
        dl += [d1] if d1 is not None else []
        dg += [d2] if d2 is not None else []
        same = ""
        if grpo:
            i = s["step"] - 1
            ho, ht = o["completion_hashes"], t["completion_hashes"]
            same = " yes |" if i < min(len(ho), len(ht)) and ho[i] == ht[i] else " no |"
        f = lambda x: "—" if x is None else f"{x:.6g}"  # noqa: E731
        out.append(f"| {s['step']} | {f(l1)} | {f(l2)} | {f(d1)} | {f(g1)} | {f(g2)} | "
                   f"{f(d2)} |{same}")
    out.append(f"\nmax abs diff: loss {max(dl, default=float('nan')):.3g}, grad-norm "
               f"{max(dg, default=float('nan')):.3g}")
    if grpo:  # sampled paths diverge: the runs agree, if at all, as samples of one process
        out.append("\n" + "; ".join(
            f"{who}: mean grad-norm {_mean(r, 'grad_norm'):.4g}, mean reward "
            f"{_mean(r, 'reward'):.4g}, KL at the last step {r['steps'][-1].get('kl', float('nan')):.3g}"
            for who, r in (("ours", o), ("TRL", t))))
    return out


def _mean(run: dict, key: str) -> float:
    vals = [st[key] for st in run["steps"] if key in st]
    return sum(vals) / len(vals) if vals else float("nan")


def plot(recs: dict, a, tag: str, out_dir: Path) -> list[str]:
    """Liger-paper style: memory and speed against length and against batch, one line per
    system; one PNG per (part, model). OOM / missing points are left out of the line."""
    plt = bc.pyplot()
    if plt is None:
        return []
    files = []
    specs = {
        "grpo": (GRPO_SYSTEMS, "L", "G", a.base_batch, a.base_length,
                 [("peak extra GiB (max of ref, loss)",
                   lambda r: max(r["ref"]["extra_bytes"] or 0, r["loss"]["extra_bytes"] or 0)
                   / E.GIB if r["ref"]["extra_bytes"] is not None else None),
                  ("ref + loss ms", lambda r: r["ref"]["ms"] + r["loss"]["ms"])]),
        "sft": (SFT_SYSTEMS, "T", "B", a.sft_base_batch, a.sft_base_length,
                [("peak extra GiB", lambda r: None if r["step"]["extra_bytes"] is None
                  else r["step"]["extra_bytes"] / E.GIB),
                 ("tokens / s", lambda r: r["tokens_per_s"])]),
    }
    for part, (systems, dl, db, base_b, base_l, metrics) in specs.items():
        models = sorted({r["model"] for r in recs.values() if r.get("part") == part})
        for model in models:
            ok = [r for r in recs.values() if r.get("part") == part and r["model"] == model
                  and r.get("status") == "ok"]
            if not ok:
                continue
            fig, axes = plt.subplots(2, 2, figsize=(10, 7), squeeze=False)
            for row, (dim, fixed_dim, fixed) in enumerate(((dl, db, base_b), (db, dl, base_l))):
                for col, (ylabel, fn) in enumerate(metrics):
                    ax = axes[row, col]
                    for s in systems:
                        pts = sorted((r[dim], fn(r)) for r in ok
                                     if r["system"] == s and r[fixed_dim] == fixed)
                        pts = [p for p in pts if p[1] is not None]
                        if pts:
                            ax.plot(*zip(*pts), marker="o", label=SYSTEM_LABEL[s])
                    ax.set_xscale("log", base=2)
                    ax.set_xlabel(f"{dim} ({fixed_dim}={fixed})")
                    ax.set_ylabel(ylabel)
                    ax.grid(alpha=0.3)
                    if ax.has_data():
                        ax.legend(fontsize=8)
            fig.suptitle(f"{part.upper()} training phase, {model}-shaped QLoRA, {tag}")
            files.append(str(out_dir / f"e2e_{tag}_{part}_{model}.png"))
            bc.save_figure(fig, Path(files[-1]))
    return files


def report(a, tag: str, jsonl: Path, out_dir: Path) -> str:
    recs = latest(bc.read_jsonl([jsonl]))
    env = {f"{r['system']}": r["env"] for r in recs.values() if r.get("part") == "env"}
    any_env = next(iter(env.values()), {})
    md = [f"# End-to-end benchmark ({tag})\n",
          f"GPU: {any_env.get('gpu') or any_env.get('cpu')}; commit {any_env.get('commit')}; "
          f"torch {any_env.get('torch')}, "
          f"transformers {any_env.get('transformers')}, peft {any_env.get('peft')}, "
          f"bitsandbytes {any_env.get('bitsandbytes')}, liger-kernel "
          f"{any_env.get('liger-kernel')}; TRL per system: "
          + ", ".join(f"{SYSTEM_LABEL.get(s, s)} {e.get('trl')}" for s, e in sorted(env.items()))
          + f"; {any_env.get('date')}.\n",
          "Extra = peak allocated during one call above what was allocated before it (loaded "
          "model, LoRA, batch); total = absolute peak incl. the model. Median of timed calls "
          "after a warm-up.\n"]
    if any(r.get("part") == "grpo" for r in recs.values()):
        md += ["## GRPO training phase (reference pass + loss forward/backward)\n",
               grpo_table(recs, a.models, GRPO_SYSTEMS), ""]
    if any(r.get("part") == "fit" for r in recs.values()):
        md += ["## Longest completion that fits (peak total incl. model and AdamW state)\n",
               fit_table(recs), ""]
    if any(r.get("part") == "sft" for r in recs.values()):
        md += ["## SFT training phase (loss forward/backward)\n",
               sft_table(recs, a.models, SFT_SYSTEMS), ""]
    if any(r.get("part") == "lossmatch" for r in recs.values()):
        md += ["## Loss match: real `trainer.train()`, per-step loss and grad-norm",
               lossmatch_tables(recs), ""]
    pngs = plot(recs, a, tag, out_dir)
    text = "\n".join(md)
    (out_dir / f"e2e_{tag}.md").write_text(text + "\n")
    (out_dir / f"e2e_{tag}.json").write_text(json.dumps(
        {"tag": tag, "env": env, "args": {k: v for k, v in vars(a).items() if k != "tasks"},
         "records": list(recs.values())}, indent=1, default=str) + "\n")
    return text + "\n\n" + "\n".join(f"wrote {p}" for p in
                                     [out_dir / f"e2e_{tag}.md", out_dir / f"e2e_{tag}.json",
                                      jsonl, *pngs])


# --------------------------------------------------------------------------- CLI


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b", help="comma list of 1b,8b (default 1b)")
    p.add_argument("--parts", default=None,
                   help=f"comma list of {','.join(PARTS)} (default: {DEFAULT_PARTS['full']}; "
                        f"--quick: {DEFAULT_PARTS['quick']}; --tiny: all)")
    p.add_argument("--systems", default=None,
                   help="comma list of ours,trl116,trl113,hf,liger (default: all that apply)")
    p.add_argument("--lengths", type=int_list, default=None, help="GRPO completion lengths L")
    p.add_argument("--batches", type=int_list, default=None, help="GRPO generation batches G")
    p.add_argument("--base-batch", type=int, default=None, help="G of the L sweep (8)")
    p.add_argument("--base-length", type=int, default=None, help="L of the G sweep (1024)")
    p.add_argument("--sft-lengths", type=int_list, default=None, help="SFT sequence lengths T")
    p.add_argument("--sft-batches", type=int_list, default=None, help="SFT batch sizes B")
    p.add_argument("--sft-base-batch", type=int, default=None, help="B of the T sweep (4)")
    p.add_argument("--sft-base-length", type=int, default=None, help="T of the B sweep (1024)")
    p.add_argument("--fit-lengths", type=int_list, default=None,
                   help="doubling grid of the fit search (512..32768)")
    p.add_argument("--fit-bisect", type=int, default=None, help="bisection steps per budget")
    p.add_argument("--reps", type=int, default=None, help="timed calls per point (3; quick 2)")
    p.add_argument("--lossmatch-variants", default=",".join(LOSSMATCH_VARIANTS),
                   help="comma list of " + ",".join(LOSSMATCH_VARIANTS))
    p.add_argument("--lossmatch-seed", type=int, default=0,
                   help="the loss-match runs' seed (keys of seeds other than 0 carry it)")
    p.add_argument("--quick", action="store_true",
                   help="small grid for a first GPU run (~6 min on an H200, 1b)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny offline Llama, no 4-bit: a CPU smoke run of every code path")
    W.add_run_args(p, device=None)
    p.add_argument("--report-only", metavar="TAG", default=None,
                   help="run nothing: rewrite e2e_TAG.{md,json,png} from e2e_TAG.jsonl in "
                   "--out-dir")
    p.add_argument("--trl113-path", default="/tmp/site113",
                   help="directory holding TRL 1.13 (pip install --target), put first on the "
                        "trl113 worker's PYTHONPATH")
    p.add_argument("--budget-min", type=float, default=None,
                   help="start no new measurement after this many minutes, then write results")
    p.add_argument("--grace-s", type=float, default=45.0,
                   help="kill a worker this long after the budget (its finished points stay)")
    p.add_argument("--resume", action="store_true",
                   help="keep the existing .jsonl and skip the points it already has")
    W.add_worker_args(p, "--part", "--tasks")
    return p


def resolve(a) -> str:
    """Fill grid defaults into `a`; return the grid name."""
    name = "tiny" if a.tiny else "quick" if a.quick else "full"
    for k, v in GRIDS[name].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.parts = (a.parts or DEFAULT_PARTS[name]).split(",")
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        raise SystemExit(f"--parts: unknown {bad}; choose from {list(PARTS)}")
    a.models = a.models.split(",")
    bad = [m for m in a.models if m not in E.MODELS]
    if bad and not a.tiny:
        raise SystemExit(f"--models: unknown {bad}; choose from {list(E.MODELS)}")
    every = sorted(set(GRPO_SYSTEMS + SFT_SYSTEMS + LOSSMATCH_SYSTEMS))
    a.systems = (a.systems or ",".join(every)).split(",")
    bad = [s for s in a.systems if s not in every]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; choose from {every}")
    a.lossmatch_variants = a.lossmatch_variants.split(",")
    bad = [v for v in a.lossmatch_variants if v not in LOSSMATCH_VARIANTS]
    if bad:
        raise SystemExit(f"--lossmatch-variants: unknown {bad}; choose from "
                         f"{list(LOSSMATCH_VARIANTS)}")
    if a.device is None:
        a.device = "cuda" if _cuda_visible() else "cpu"
    return name


def _cuda_visible() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.worker:
        return worker_main(a)
    grid = resolve(a)
    if a.report_only:  # tables, plots and JSON again from a finished run's lines
        out_dir = Path(a.out_dir)
        print(report(a, a.report_only, out_dir / f"e2e_{a.report_only}.jsonl", out_dir))
        return 0
    t_start = time.time()
    deadline = t_start + 60 * a.budget_min if a.budget_min else float("inf")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = bc.gpu_tag(a.device) + ("" if grid == "full" else f"_{grid}")
    jsonl = out_dir / f"e2e_{tag}.jsonl"
    if jsonl.exists() and not a.resume:
        jsonl.rename(jsonl.with_suffix(".jsonl.bak"))
        print(f"moved the previous {jsonl.name} to {jsonl.name}.bak (use --resume to add to it)")
    jobs = plan(a, grid)
    for job in jobs:
        if time.time() > deadline:
            print(f"budget of {a.budget_min} min reached: {job['part']} {job['model']} "
                  f"{job['system']} and later jobs not started", flush=True)
            break
        run_job(job, a, jsonl, deadline)
    print(report(a, tag, jsonl, out_dir))
    print(f"\ntotal {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
