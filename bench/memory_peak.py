"""What is allocated at each part's memory peak of a GRPO step, by allocation site.

bench.grpo_step reports each part's peak (max_memory_allocated above the loaded model); this
lab tool says what makes it up. One worker process per system runs `trainer.train()` for
--steps steps of the same trainer bench.grpo_step builds, with
`torch.cuda.memory._record_memory_history` on from before the trainer is built, so every block
the trainer allocates is in the trace. Replaying the trace gives, for each part of the last
step (generation, ref, loss, optimizer), the moment of its peak and the blocks live then,
grouped by the part that allocated them and by their allocation site (the innermost Python
frames outside torch). Blocks allocated while a CUDA graph is captured count as the allocator
counts them: live until freed, whatever pool they are in.

Systems are bench.grpo_step's. For `trl` and `ours_eager` generation can be replaced by fixed
full-length completions (--fixed-completions, the default), so that their loss passes run on
the same shapes as the decode loop's random-init completions (which never stop) without the
minute per step that TRL's generation takes at batch 64.

    python -m bench.memory_peak --systems trl,ours_eager,ours_loop --prompts 8 --L 512
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench import common as bc
from bench import workers as W

PARTS = ("generation", "ref", "loss", "optimizer")
MARKER = "_phase_marker"
SKIP_FRAMES = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")


def _phase_marker(name: str, names: list[str]) -> None:
    """An allocation whose stack names this function: the trace's marker of part `name`'s
    start (names[k] is the k-th marker's part)."""
    import torch

    names.append(name)
    torch.empty(1, device="cuda")


def site(frames: list[dict], depth: int = 2) -> str:
    """The `depth` innermost Python frames outside torch and the standard library, as
    'file:line name' joined by ' < ' (innermost first)."""
    out = []
    for f in frames:
        fn = f.get("filename", "")
        if any(s in fn for s in SKIP_FRAMES) or fn.startswith("??"):
            continue
        short = fn.split("site-packages/")[-1]
        short = short.split(str(W.ROOT) + "/")[-1]
        out.append(f"{short}:{f.get('line')} {f.get('name')}")
        if len(out) == depth:
            break
    return " < ".join(out) or "(no Python frame outside torch)"


def replay(trace: list[dict], names: list[str]) -> dict:
    """{(last step, part): {"peak": bytes, "live": [(size, (step, part) allocating it, site)]}}
    from a device trace and the marker names in order. A step starts at each "generation"
    marker; bytes are the allocator's allocated bytes relative to the start of the recording.
    Two passes: the peaks, then the live blocks at the last step's peaks."""
    markers = [i for i, e in enumerate(trace) if e["action"] == "alloc"
               and any(f.get("name") == MARKER for f in e.get("frames", []))]
    if len(markers) != len(names):
        raise RuntimeError(f"{len(markers)} marker allocations in the trace, {len(names)} "
                           "markers made: the trace buffer dropped events (raise max_entries)")
    part_at = {}
    step = 0
    for i, name in zip(markers, names):
        if name == "generation":
            step += 1
        part_at[i] = (step, name)

    def walk(snap_at=frozenset()):
        """One pass: each part's (peak bytes, event index), and the live blocks (size,
        allocating part, frames) at each event index in `snap_at`."""
        live, cur, where = {}, 0, (0, "setup")
        peaks, snaps = {}, {}
        for i, e in enumerate(trace):
            if i in part_at:  # a marker: not counted (its free finds nothing live)
                where = part_at[i]
                continue
            a = e["action"]
            if a == "alloc":
                live[e["addr"]] = (e["size"], where, e.get("frames", []))
                cur += e["size"]
                if cur > peaks.get(where, (-1,))[0]:
                    peaks[where] = (cur, i)
            elif a == "free_completed" and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
            if i in snap_at:
                snaps[i] = list(live.values())
        return peaks, snaps

    peaks, _ = walk()
    last = max(s for s, _ in peaks)
    wanted = {where: p for where, p in peaks.items() if where[0] == last}
    _, snaps = walk({i for _, i in wanted.values()})
    return {where: {"peak": peak, "live": [(s, w, site(fr)) for s, w, fr in snaps[i]]}
            for where, (peak, i) in wanted.items()}


def summarize(live: list, top: int = 25) -> list[dict]:
    """Live blocks grouped by (allocating step and part, site), largest first."""
    groups = defaultdict(lambda: [0, 0])
    for size, where, s in live:
        g = groups[(f"{where[0]}:{where[1]}", s)]
        g[0] += size
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"allocated_in": k[0], "site": k[1], "bytes": v[0], "blocks": v[1]}
            for k, v in rows]


def fixed_generation(G: int, prompts: int, L: int):
    """_generate_single_turn's stand-in: prompts·G completions of L tokens from ids 3..999
    (no special token, so none stops early)."""
    rng = random.Random(0)
    fixed = [[rng.randrange(3, 1000) for _ in range(L)] for _ in range(prompts * G)]
    return lambda *args, **kw: (fixed, None)


def worker(a) -> int:
    import torch
    from transformers import AutoTokenizer

    from bench import e2e_common as E
    from bench.grpo_step import build_trainer

    write = W.Sink(a.jsonl, system=a.system, model=a.model).write
    write({"kind": "env", "env": W.worker_env("cuda")})
    path = E.model_dir(a.model, a.model_cache)
    tok = AutoTokenizer.from_pretrained(path)
    model = E.load_model(path, device="cuda", quantize=True)
    bc.free_memory()
    base = torch.cuda.memory_allocated()
    names: list[str] = []
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    from transformers import TrainerCallback

    with tempfile.TemporaryDirectory() as out:
        tr = build_trainer(a.system, model, tok, G=a.generations, L=a.L, steps=a.steps,
                           device="cuda", out=out, prompts=a.prompts)
        if a.fixed_completions and a.system in ("trl", "ours_eager"):
            tr._generate_single_turn = fixed_generation(a.generations, a.prompts, a.L)
        gen, logps = tr._generate_single_turn, tr._get_per_token_logps_and_entropies

        def generation(*args, **kw):
            _phase_marker("generation", names)
            out_ = gen(*args, **kw)
            _phase_marker("score", names)
            return out_

        def ref(*args, **kw):
            if not torch.is_grad_enabled():
                _phase_marker("ref", names)
            return logps(*args, **kw)

        compute_loss = tr.compute_loss

        def loss(*args, **kw):
            _phase_marker("loss", names)
            return compute_loss(*args, **kw)

        class Optimizer(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                _phase_marker("optimizer", names)

            def on_step_end(self, args, state, control, **kw):
                _phase_marker("end", names)

        tr._generate_single_turn, tr._get_per_token_logps_and_entropies = generation, ref
        tr.compute_loss = loss
        tr.add_callback(Optimizer())
        t0 = time.perf_counter()
        tr.train()
        train_s = time.perf_counter() - t0
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        peaks = replay(trace, names)
        last = max(s for s, _ in peaks)
        rec = {"kind": "point", "L": a.L, "G": a.generations, "prompts": a.prompts,
               "model_bytes": base, "train_s": train_s, "events": len(trace),
               "reserved_bytes": torch.cuda.memory_reserved() - base, "parts": {}}
        for part in PARTS:
            p = peaks.get((last, part))
            if p is None:
                continue
            rec["parts"][part] = {"peak_bytes": p["peak"], "groups": summarize(p["live"])}
        write(rec)
        print(report_system(rec, a.system), flush=True)
    return 0


def report_system(rec: dict, system: str) -> str:
    lines = [f"## {system}: {rec['events']} trace events, train {rec['train_s']:.1f} s", ""]
    for part, p in rec["parts"].items():
        lines += [(f"### {part} of the last step: peak {p['peak_bytes'] / 2**30:.3f} GiB "
                   "above the loaded model"), "", "| GiB | blocks | allocated in | site |",
                  "|---|---|---|---|"]
        lines += [f"| {g['bytes'] / 2**30:.3f} | {g['blocks']} | {g['allocated_in']} | "
                  f"{g['site']} |" for g in p["groups"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b")
    p.add_argument("--systems", default="trl,ours_eager,ours_loop")
    p.add_argument("--L", type=int, default=512)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="the last one is reported")
    p.add_argument("--fixed-completions", type=int, default=1,
                   help="1: trl and ours_eager train on fixed full-length completions")
    p.add_argument("--tag", default="")
    W.add_run_args(p)
    W.add_worker_args(p)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    gpu = bc.gpu_tag(a.device)
    stem = Path(a.out_dir) / f"memory_peak_{gpu}{a.tag}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    jsonl = stem.with_suffix(".jsonl")
    for model in a.models.split(","):
        for system in a.systems.split(","):
            argv_ = W.worker_argv("bench.memory_peak", a, ("model_cache",), system=system,
                                  model=model, jsonl=jsonl, L=a.L, generations=a.generations,
                                  prompts=a.prompts, steps=a.steps,
                                  fixed_completions=a.fixed_completions)
            run = W.run_worker(argv_, jsonl)
            if run.status:
                print(f"[{system}] {run.status}", flush=True)
    recs = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    md = [f"# bench.memory_peak on {gpu}", ""]
    for r in recs:
        if r.get("kind") == "point":
            md.append(report_system(r, r["system"]))
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {stem.with_suffix('.md')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
