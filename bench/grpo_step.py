"""The whole GRPO step inside a real `trainer.train()`: generation, scoring and the reference
pass, loss forward and backward, optimizer step; per-part time and peak memory.

Systems (one worker process each, one after the other in one call, on the same data):

    trl          stock trl.GRPOTrainer (1.16), its default generation (dynamic cache, eager)
    trl_static   the same with GRPOConfig(cache_implementation="static")
    ours         trainers.GRPOTrainer(sampler="compiled"): today's FastSampler (static cache,
                 compiled decode step), packing="auto"
    ours_loop    trainers.GRPOTrainer(sampler="loop"): our decode loop
                 (trainers.sampling.loop.DecodeLoop); a call it cannot serve goes to TRL's
                 generate, which the record's `served` counts show
    ours_eager   trainers.GRPOTrainer(fast_generation=False)

Model: a Llama-3.2-1B- or 3.1-8B-shaped model (random init, bench.e2e_common), NF4 double-quant
base, loaded once per worker; each point's trainer gets `peft_config` = LoRA r=16 on every linear
layer (TRL keeps QLoRA adapters in bf16) and unloads it at the end; SDPA, gradient
checkpointing as TRL's train() leaves it; G = --generations completions of one 64-token prompt
per step (--prompts distinct prompts x G: batch 8 = 1 x 8, batch 64 = 8 x 8), beta = 0.04 (a
reference pass with the adapter disabled), loss "dapo". Between points
the compiled code is reset, so each point compiles as a new run would (inductor's on-disk kernel
cache persists, as it does between a user's runs).

--completions sampled: completions are sampled with max_completion_length = L. A random-init
  model never emits EOS, so every completion runs to L tokens.
--completions synthetic: generation is replaced by fixed ragged completions of ⌈L·(i+1)/G⌉
  random tokens (56 % mean fill at G = 8, as bench.e2e's training-phase batches), so the rest
  of the real step (scoring, reference pass, loss, backward, optimizer) is timed at that fill.
  In the same worker, after train(), the training phase is also timed the way bench.e2e's
  `grpo` part does it (direct calls of the reference pass and compute_loss + backward), so the
  two methods are compared on one trainer.

Parts and how they are timed (torch.cuda.synchronize at each boundary; a part's peak is
max_memory_allocated during the part minus the memory the loaded base model takes, so it counts
the LoRA adapter, its optimizer state and, for grpo_lce, the static KV cache that stays
allocated between generations; "training peak" is the largest of ref, loss and optimizer;
"first step" is that of each point's first step, where no system holds optimizer state yet: the
timed steps of the compiled systems come after their first, whose optimizer step made AdamW's
state, while the others' one timed step is their first, so only the first steps compare alike;
"over TRL + KV cache" is a decode-loop point's first-step training peak minus TRL's at the same
point and minus the KV caches the loop holds, issue 27's memory target):

    generation   trainer._generate_single_turn (sampling only); per decode step (the batch's
                 longest completion): wall ms, and the GPU time inside CUDA-graph replays
                 (bench.graph_time) against the rest ("outside": Python, eager kernels, syncs)
    score_ref    the rest of _generate_and_score_completions: rewards, reference pass, advantages
    ref          the no-grad log-prob passes alone (inside score_ref)
    loss         compute_loss + accelerator.backward
    optimizer    on_pre_optimizer_step -> on_optimizer_step (clipping and AdamW)
    step         on_step_begin -> on_step_end

The first --warmup steps of each `ours` / `ours_loop` point are not counted: they compile or
capture, and that one-time cost is reported on its own (FastSampler's compile_s, the loop's
capture_s). The other systems have nothing to compile; a 1-step run at L = 8
before their first point takes CUDA and library start-up off the clock (--warmup-eager 0).

    python -m bench.grpo_step --models 1b --lengths 256,512,1024
    python -m bench.grpo_step --models 8b --lengths 512
    python -m bench.grpo_step --models 1b --lengths 1024,4096 --completions synthetic \\
        --systems trl,ours --steps 4
    python -m bench.grpo_step --tiny --device cpu          # smoke run
    python -m bench.grpo_step --quick                      # 1b, L = 512, batch 8: trl, ours,
                                                           # ours_loop (about 6 min on an H100)
    python -m bench.grpo_step --models 1b --lengths 512 --systems trl,trl_static,ours,ours_loop
    python -m bench.grpo_step --models 1b --lengths 512 --prompts 8 --tag _b64 \
        --systems trl,trl_static,ours,ours_loop
    python -m bench.grpo_step --models 8b --lengths 512 --systems trl,ours,ours_loop

Writes bench/results/grpo_step_<GPU>[_<tag>].jsonl (raw records), .json, .md and, for sampled
runs with several lengths, a .png of step time and generation peak against L.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench import common as bc
from bench import e2e_common as E
from bench import workers as W

SYSTEMS = ("trl", "trl_static", "ours", "ours_loop", "ours_eager")
LABEL = {"trl": "TRL 1.16", "trl_static": "TRL 1.16, static cache",
         "ours": "grpo_lce, FastSampler", "ours_loop": "grpo_lce, decode loop",
         "ours_eager": "grpo_lce, fast_generation=False"}
COMPILED = ("ours", "ours_loop")  # systems with a one-time compile / capture
PARTS = ("generation", "score_ref", "ref", "loss", "optimizer", "step")
# the driver's options its workers get
WORKER_OPTIONS = ("lengths", "completions", "generations", "prompts", "warmup", "warmup_eager",
                  "steps", "device", "model_cache")


# =========================================================================== worker


class PartTimer:
    """Per-part wall time (CUDA-synchronized) and peak memory above `base` bytes, per step."""

    def __init__(self, cuda: bool, base: int):
        self.cuda, self.base = cuda, base
        self.step: dict = {}
        self.steps: list[dict] = []
        self._open: dict = {}

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def start(self, part: str, reset_peak: bool = True):
        import torch

        self._sync()
        if self.cuda and reset_peak:
            torch.cuda.reset_peak_memory_stats()
        self._open[part] = time.perf_counter()

    def stop(self, part: str, peak: bool = True):
        import torch

        self._sync()
        dt = time.perf_counter() - self._open.pop(part)
        rec = self.step.setdefault(part, {"s": 0.0, "peak_bytes": 0})
        rec["s"] += dt
        if self.cuda and peak:
            peak_now = torch.cuda.max_memory_allocated() - self.base
            rec["peak_bytes"] = max(rec["peak_bytes"], peak_now)
        return dt

    def wrap(self, fn, part, when=lambda *a, **k: True, reset_peak=True):
        def wrapped(*args, **kwargs):
            if not when(*args, **kwargs):
                return fn(*args, **kwargs)
            self.start(part, reset_peak)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop(part, peak=reset_peak)
        return wrapped


def attach(tr, timer: PartTimer):
    """Wrap the trainer's methods and add a callback so that each part is timed."""
    import torch
    from transformers import TrainerCallback

    from bench.graph_time import GraphReplayTimer

    single_turn = tr._generate_single_turn

    def timed_single_turn(*args, **kwargs):
        """Decode steps of this call (its longest completion) and the GPU time inside
        CUDA-graph replays, added to the step's "decode" record."""
        with GraphReplayTimer() as graphs:
            out = single_turn(*args, **kwargs)
        completions = out[0] if isinstance(out, tuple) else out
        rec = timer.step.setdefault("decode", {"steps": 0, "tokens": 0, "graph_s": 0.0,
                                               "replays": 0})
        rec["steps"] += max((len(c) for c in completions), default=0)
        rec["tokens"] += sum(len(c) for c in completions)
        rec["graph_s"] += graphs.seconds()
        rec["replays"] += graphs.replays
        return out

    tr._generate_single_turn = timer.wrap(timed_single_turn, "generation")
    tr._get_per_token_logps_and_entropies = timer.wrap(
        tr._get_per_token_logps_and_entropies, "ref",
        when=lambda *a, **k: not torch.is_grad_enabled(), reset_peak=True)
    gen_score = tr._generate_and_score_completions

    def gen_and_score(*args, **kwargs):
        timer.start("_gen_score", reset_peak=False)
        try:
            return gen_score(*args, **kwargs)
        finally:
            total = timer.stop("_gen_score", peak=False)
            gen = timer.step.get("generation", {}).get("s", 0.0)
            timer.step["score_ref"] = {"s": total - gen, "peak_bytes": None}
            timer.step.pop("_gen_score", None)
    tr._generate_and_score_completions = gen_and_score

    compute_loss, backward = tr.compute_loss, tr.accelerator.backward

    def loss(*args, **kwargs):
        timer.start("loss")
        return compute_loss(*args, **kwargs)

    def bwd(*args, **kwargs):
        try:
            return backward(*args, **kwargs)
        finally:
            timer.stop("loss")
    tr.compute_loss, tr.accelerator.backward = loss, bwd

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timer.step = {}
            timer.start("step", reset_peak=False)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            timer.start("optimizer")

        def on_optimizer_step(self, args, state, control, **kw):
            timer.stop("optimizer")

        def on_step_end(self, args, state, control, **kw):
            timer.stop("step", peak=False)
            timer.steps.append(timer.step)
    tr.add_callback(Steps())


def synthetic_completions(G: int, L: int, V: int, seed: int = 0):
    """G completions of ⌈L·(i+1)/G⌉ random tokens (shuffled): 56 % mean fill at G = 8."""
    rng = random.Random(seed)
    lens = [-(-L * (i + 1) // G) for i in range(G)]
    rng.shuffle(lens)
    return [[rng.randrange(3, V) for _ in range(n)] for n in lens]


def build_trainer(system, model, tok, *, G, L, steps, device, out, seed=0, prompts=1):
    """A GRPO trainer of `system` over `model` with a fresh LoRA adapter (peft_config)."""
    import trl
    from datasets import Dataset

    def reward(completions, **kw):  # varied rewards, so advantages are not all zero
        return [random.Random(hash(str(c)) % 2**32).random() for c in completions]

    extra = {"cache_implementation": "static"} if system == "trl_static" else {}
    args = trl.GRPOConfig(
        output_dir=out, report_to="none", save_strategy="no", logging_steps=1, seed=seed,
        per_device_train_batch_size=prompts * G, num_generations=G, max_completion_length=L,
        max_steps=steps, learning_rate=1e-5, beta=0.04, loss_type="dapo",
        bf16=device == "cuda", use_cpu=device == "cpu", **E.checkpointing_kw(True), **extra)
    prompt = "Write a long story about a llama who learns to count. " * 2
    # distinct prompts of one length (64 characters), so every batch has the same prompt shape
    texts = [f"{i:03d} {prompt}"[:64] for i in range(prompts)]
    ds = Dataset.from_dict({"prompt": texts * (G * steps)})
    if system.startswith("ours"):
        from trainers import GRPOTrainer

        kw = {"ours": {"sampler": "compiled"}, "ours_loop": {"sampler": "loop"},
              "ours_eager": {"fast_generation": False}}[system]
    else:
        GRPOTrainer, kw = trl.GRPOTrainer, {}
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                       processing_class=tok, peft_config=E.lora_config(), **kw)


def direct_training_phase(tr, G, L, V, device, reps=3) -> dict:
    """bench.e2e's `grpo` part on this trainer: the reference pass and compute_loss + backward
    called directly on a synthetic batch (56 % fill), median ms of `reps` after one warm-up."""
    from bench.e2e import grpo_point

    r = grpo_point(tr, G=G, L=L, V=V, device=device, reps=reps)
    return {"ref_ms": r["ref"]["ms"], "loss_ms": r["loss"]["ms"],
            "ref_extra_bytes": r["ref"]["extra_bytes"],
            "loss_extra_bytes": r["loss"]["extra_bytes"]}


def fresh_compile_state(model) -> None:
    """Drop dynamo's compiled code, its CUDA graphs and transformers' cached compiled call, so
    that the next point starts as a new run would (inductor's on-disk kernel cache stays)."""
    import torch

    model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("_last_compile_config", None)
    torch.compiler.reset()


def point(a, L: int) -> dict:
    """The fields naming one point of a worker's run (`current_points` keys on them)."""
    return {"kind": "point", "L": L, "G": a.generations, "prompts": a.prompts,
            "batch": a.prompts * a.generations, "completions": a.completions}


def worker(a) -> int:
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    cuda = a.device == "cuda"
    write = W.Sink(a.jsonl, system=a.system, model=a.model).write
    compiled = a.system in COMPILED
    warmup = a.warmup if compiled else a.warmup_eager
    write({"kind": "env", "env": W.worker_env(a.device)})
    path = E.model_dir(a.model, a.model_cache)
    tok = AutoTokenizer.from_pretrained(path)
    model = E.load_model(path, device=a.device, quantize=cuda and a.model != "tiny")
    bc.free_memory()
    base = torch.cuda.memory_allocated() if cuda else 0
    V = model.config.vocab_size

    def run_point(L, steps, rec):
        """train() for `steps` steps at completion length L: the trainer wraps `model` with a
        fresh LoRA adapter (peft_config, as a user passes it); unwrapped again at the end."""
        nonlocal model
        tr = None
        with tempfile.TemporaryDirectory() as out:
            try:
                tr = build_trainer(a.system, model, tok, G=a.generations, L=L, steps=steps,
                                   device=a.device, out=out, prompts=a.prompts)
                if a.completions == "synthetic":
                    fixed = synthetic_completions(a.generations, L, V)
                    tr._generate_single_turn = lambda *args, **kw: (fixed, None)
                timer = PartTimer(cuda, base)
                attach(tr, timer)
                t0 = time.perf_counter()
                tr.train()
                rec["train_s"] = time.perf_counter() - t0
                rec["steps"] = timer.steps
                hist = [h for h in tr.state.log_history if "loss" in h]
                rec["loss"] = [h["loss"] for h in hist]
                rec["completion_mean_length"] = [h.get("completions/mean_length") for h in hist]
                samplers = getattr(tr, "_lce_samplers", None)
                if samplers is not None:
                    sampler = samplers.compiled
                    rec["sampler"] = {**vars(sampler.stats), "off": sampler.disabled_reason}
                    rec["served"] = dict(samplers.served)
                    loop = samplers._loop
                    if loop is not None or samplers.loop_off is not None:
                        rec["loop"] = {**(vars(loop.stats) if loop is not None else {}),
                                       "off": samplers.loop_off or getattr(
                                           loop, "disabled_reason", None),
                                       "cache_bytes": loop.cache_bytes() if loop else None}
                if a.completions == "synthetic":
                    rec["direct"] = direct_training_phase(tr, a.generations, L, V, a.device)
                rec["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - recorded; the next point runs
                import traceback

                traceback.print_exc()
                rec["status"] = bc.short_error(exc, 300)
            if tr is not None:
                model = tr.accelerator.unwrap_model(tr.model).unload()
            del tr
            fresh_compile_state(model)
            bc.free_memory()

    if not compiled and a.warmup_eager == 0:
        run_point(8, 1, {})  # CUDA, cuBLAS and allocator start-up, off the clock
    for L in a.lengths:
        if time.time() > a.deadline:
            write({**point(a, L), "status": "skipped: time budget"})
            continue
        rec = {**point(a, L), "warmup": warmup, "model_bytes": base}
        run_point(L, warmup + a.steps, rec)
        write(rec)
        print(f"[{a.system} L={L}] {fmt(rec)}", flush=True)
    return 0


# =========================================================================== driver


TRAINING_PARTS = ("ref", "loss", "optimizer")


def part_value(step: dict, part: str, key: str):
    """One step's `key` ("s" or "peak_bytes") of `part`; "training" peak = the largest of the
    reference pass, loss and optimizer peaks (peaks are reset at each part's start)."""
    if part == "training":
        vals = [step[p][key] for p in TRAINING_PARTS if step.get(p, {}).get(key) is not None]
        return max(vals) if vals else None
    return step.get(part, {}).get(key)


def median_part(rec: dict, part: str, key: str = "s"):
    vals = [v for s in rec["steps"][rec["warmup"]:]
            if (v := part_value(s, part, key)) is not None]
    return statistics.median(vals) if vals else None


def fmt(rec: dict) -> str:
    if rec.get("status") != "ok":
        return rec.get("status", "?")
    out = []
    for part in PARTS:
        s = median_part(rec, part)
        if s is not None:
            out.append(f"{part} {s:.2f} s")
    return ", ".join(out)


def current_points(recs: list[dict]) -> list[dict]:
    """The newest record of each (model, L, system, G, completions) point (a measured one over a
    newer skipped one), each tagged with the commit of the worker's env record written before it
    (a worker writes its env line first)."""
    commit, points = {}, []
    for r in recs:
        who = (r.get("system"), r.get("model"))
        if r.get("kind") == "env":
            commit[who] = r["env"].get("commit")
        elif r.get("kind") == "point":
            points.append({**r, "commit": commit.get(who)})
    return bc.newest_points(points, lambda r: (r["model"], r["L"], r["system"], r.get("G"),
                                               r.get("prompts", 1), r.get("completions")))


def gib(b, spec=".2f"):
    return "" if b is None else format(b / 2**30, spec)


def first_peak(rec: dict):
    """The training peak of a point's first step (bytes above the model), or None."""
    return part_value(rec["steps"][0], "training", "peak_bytes") if rec.get("steps") else None


def over_trl_and_cache(rec: dict, trl: dict | None):
    """MiB by which a decode-loop point's first-step training peak exceeds TRL's at the same
    point plus the loop's KV caches (issue 27's memory target), or None where either is not
    recorded."""
    cache = (rec.get("loop") or {}).get("cache_bytes")
    ours, theirs = first_peak(rec), None if trl is None else first_peak(trl)
    if cache is None or ours is None or theirs is None:
        return None
    return (ours - theirs - cache) / 2**20


def decode_split(rec: dict):
    """(wall, inside graphs, outside) ms per decode step, medians over the timed steps, from
    the generation part's time and the "decode" record (None where not measured)."""
    walls, insides = [], []
    for step in rec["steps"][rec["warmup"]:]:
        d, g = step.get("decode"), step.get("generation")
        if d and g and d["steps"]:
            walls.append(1e3 * g["s"] / d["steps"])
            insides.append(1e3 * d["graph_s"] / d["steps"])
    if not walls:
        return None, None, None
    wall, inside = statistics.median(walls), statistics.median(insides)
    return wall, inside, wall - inside


def one_time(r: dict) -> str:
    """FastSampler's compiles and the loop's captures, with their seconds; why either was off;
    which sampler served how many calls."""
    s, lp = r.get("sampler") or {}, r.get("loop") or {}
    out = []
    if s.get("compiles"):
        out.append(f"{s['compiles']} compiles ({s['compile_s']:.0f} s)")
    if lp.get("captures"):
        out.append(f"{lp['captures']} captures ({lp['capture_s']:.1f} s)")
    if lp.get("first_token_s") is not None:
        out.append(f"first token after {lp['first_token_s']:.1f} s")
    if s.get("off") and r["system"] == "ours":
        out.append(f"FastSampler off: {s['off']}")
    if lp.get("off") and r["system"] == "ours_loop":
        out.append(f"loop off: {lp['off']}")
    served = r.get("served")
    if served and r["system"] in COMPILED:
        out.append("served " + ", ".join(f"{k} {v}" for k, v in served.items() if v))
    return "; ".join(out)


def table(pts: list[dict]) -> str:
    """One row per point of `current_points`; peaks are above the loaded model, and the
    generation peak also in total (model included)."""
    lines = ["| model | batch | L | system | step s | vs TRL | generation s | ms / decode step "
             "| in graphs | outside | score+ref s | loss fwd+bwd s | optimizer s "
             "| generation peak GiB | generation peak total GiB | training peak GiB "
             "| training peak, first step GiB | first step over TRL + KV cache MiB "
             "| one-time cost | commit |",
             "|" + "---|" * 20]

    def batch(r):
        return r.get("batch", r.get("G"))

    trl = {(r["model"], batch(r), r["L"]): r for r in pts
           if r["system"] == "trl" and r.get("status") == "ok"}
    ref = {k: median_part(r, "step") for k, r in trl.items()}
    for r in sorted(pts, key=lambda r: (r["model"], batch(r) or 0, r["L"],
                                        SYSTEMS.index(r["system"]))):
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {batch(r)} | {r['L']} | {LABEL[r['system']]} "
                         f"| {r['status']} |" + " |" * 14 + f" {r['commit']} |")
            continue
        step = median_part(r, "step")
        base = ref.get((r["model"], batch(r), r["L"]))
        parts = [median_part(r, q) for q in ("generation", "score_ref", "loss", "optimizer")]
        wall, inside, outside = decode_split(r)
        gen_peak = median_part(r, "generation", "peak_bytes")
        gen_total = None if gen_peak is None or r.get("model_bytes") is None \
            else gen_peak + r["model_bytes"]

        def f(v, spec=".2f"):
            return "" if v is None else format(v, spec)

        cells = [r["model"], batch(r), r["L"], LABEL[r["system"]], f"{step:.2f}",
                 f"{step / base:.2f}x" if base else "", f(parts[0]), f(wall), f(inside),
                 f(outside), *(f(v) for v in parts[1:]), gib(gen_peak), gib(gen_total),
                 gib(median_part(r, "training", "peak_bytes")),
                 gib(first_peak(r), ".3f"), f(over_trl_and_cache(r, trl.get(
                     (r["model"], batch(r), r["L"]))), "+.2f"), one_time(r), r["commit"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    direct = [r for r in pts if r.get("direct")]
    if direct:
        lines += ["", "Training phase at 56 % fill, inside train() against direct calls "
                  "(bench.e2e's method), ms:", "",
                  "| model | L | system | ref (train) | loss fwd+bwd (train) | ref (direct) | "
                  "loss fwd+bwd (direct) |", "|---|---|---|---|---|---|---|"]
        for r in direct:
            d = r["direct"]
            lines.append(f"| {r['model']} | {r['L']} | {LABEL[r['system']]} | "
                         f"{1e3 * median_part(r, 'ref'):.0f} | {1e3 * median_part(r, 'loss'):.0f}"
                         f" | {d['ref_ms']:.0f} | {d['loss_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(pts: list[dict], path: Path) -> bool:
    pts = [r for r in pts if r.get("status") == "ok"]
    models = sorted({r["model"] for r in pts})
    if not pts or max(len({r["L"] for r in pts if r["model"] == m}) for m in models) < 2:
        return False
    plt = bc.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for row, m in enumerate(models):
        for col, (label, part, key, scale) in enumerate(
                (("whole step, s", "step", "s", 1), ("generation peak, GiB", "generation",
                                                     "peak_bytes", 2**-30))):
            ax = axes[row, col]
            for s in SYSTEMS:
                xy = sorted((r["L"], median_part(r, part, key) * scale) for r in pts
                            if r["model"] == m and r["system"] == s
                            and median_part(r, part, key) is not None)
                if xy:
                    ax.plot(*zip(*xy), marker="o", label=LABEL[s])
            ax.set_xscale("log", base=2)
            ax.set_xlabel("completion length L (G = 8)")
            ax.set_ylabel(label)
            ax.set_title(f"{m}-shaped NF4 + LoRA")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    bc.save_figure(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b")
    p.add_argument("--lengths", default="256,512,1024")
    p.add_argument("--systems", default="trl,trl_static,ours")
    p.add_argument("--completions", choices=("sampled", "synthetic"), default="sampled")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=1,
                   help="distinct prompts per step; the batch is prompts x generations")
    p.add_argument("--quick", action="store_true",
                   help="1b, L = 512, batch 8, systems trl, ours, ours_loop (~6 min, H100)")
    p.add_argument("--warmup", type=int, default=1,
                   help="steps not counted per point for `ours` (the first one compiles)")
    p.add_argument("--warmup-eager", type=int, default=0,
                   help="steps not counted per point for the other systems (with 0, a 1-step "
                        "run at L = 8 first takes the process start-up off the clock)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per point")
    p.add_argument("--budget-min", type=float, default=9.0,
                   help="start no new point after this many minutes")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths (CPU smoke run)")
    W.add_run_args(p)
    p.add_argument("--tag", default="")
    p.add_argument("--report", metavar="JSONL", default=None,
                   help="write the .md, .json and .png of an existing records file; run nothing")
    W.add_worker_args(p)
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in str(a.lengths).split(",")]
    if a.worker:
        return worker(a)
    if a.report:
        write_report(Path(a.report), a)
        return 0
    if a.quick:
        a.models, a.lengths, a.systems = "1b", [512], "trl,ours,ours_loop"
        a.budget_min = min(a.budget_min, 7.0)
    if a.tiny:
        a.models, a.lengths, a.generations = "tiny", [8, 16], 4
        a.tag = a.tag or "_tiny"
    gpu = bc.gpu_tag(a.device)
    suffix = a.tag + ("" if a.completions == "sampled" else "_synthetic")
    stem = Path(a.out_dir) / f"grpo_step_{gpu}{suffix}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    jsonl = stem.with_suffix(".jsonl")
    deadline = time.time() + 60 * a.budget_min
    for model in a.models.split(","):
        for system in a.systems.split(","):
            if system not in SYSTEMS:
                p.error(f"--systems: unknown system {system!r} (choose from {SYSTEMS})")
            if time.time() > deadline:
                print(f"budget reached: {model} {system} not started", flush=True)
                continue
            print(f"[{model} {system}]", flush=True)
            run = W.run_worker(W.worker_argv("bench.grpo_step", a, WORKER_OPTIONS, system=system,
                                             model=model, jsonl=jsonl, deadline=deadline), jsonl)
            # a crash: the point it was on gets the reason, later ones were not run
            left = W.unrecorded(run, [point(a, L) for L in a.lengths],
                                key=lambda r: (r.get("kind"), r.get("L")))
            if run.status and left:
                W.Sink(jsonl, system=system, model=model).write({**left[0], "status": run.status})
    write_report(jsonl, a)
    return 0


def write_report(jsonl: Path, a) -> None:
    """The .md table, .json records and .png plot of `jsonl`, beside it."""
    recs = bc.read_jsonl([jsonl])
    pts = current_points(recs)
    stem = jsonl.with_suffix("")
    gpus = sorted({r["env"].get("gpu") or "cpu" for r in recs if r.get("kind") == "env"})
    completions = sorted({r["completions"] for r in pts if "completions" in r})
    md = (f"# bench.grpo_step on {', '.join(gpus)}: {', '.join(completions)} completions, "
          f"G = {a.generations}, batch {a.prompts * a.generations}\n\n"
          f"Medians over the timed steps of each point after the uncounted ones (grpo_lce: its "
          f"compile step; the others: none, after a 1-step run at L = 8); the newest record of "
          f"each point in {jsonl.name} (raw, all runs).\n\n"
          + table(pts))
    bc.write_report(stem, md, recs, lambda path: plot(pts, path))


if __name__ == "__main__":
    raise SystemExit(main())
