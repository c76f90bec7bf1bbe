"""The whole GRPO step with fast generation under DDP: N GPUs against 1 (weak scaling).

Each rank runs `trainer.train()` of trainers.GRPOTrainer (packing "auto"; `--system ours_loop`,
the default: the decode loop, the trainer's default sampler; `ours`: the compiled FastSampler)
on its own copy of the model, so each rank captures (or compiles) its own decode step. Same
set-up as bench.grpo_step's `ours` / `ours_loop` systems: a Llama-3.2-1B-shaped model (random
init, never emits EOS, so every completion is L tokens), NF4 double-quant base, LoRA r=16 on
every linear layer, G completions of one 64-character prompt per rank and step, β = 0.04, dapo.

Reported per world size P, from rank 0 and gathered from every rank:
    step_s        median whole-step time after the warm-up steps (on_step_begin -> on_step_end;
                  the DDP all-reduce of the backward synchronizes the ranks inside it)
    generation_s  median of the sampling part alone (rank 0)
    compile_s     each rank's one-time capture (decode loop) or compile (compiled sampler)
    wait_s        each rank's first step minus its own compile and minus its steady step: the
                  time it spent waiting for another rank (a slower compile, a collective)
    efficiency    step_s(1) / step_s(P): completions per second over P · those of one GPU

    python3 -m bench.grpo_ddp --nprocs 1,2                    # 2 GPUs; ~6 min on H100s
    python3 -m bench.grpo_ddp --nprocs 1,2 --model tiny --device cpu --steps 2   # CPU smoke

Writes bench/results/grpo_ddp_<GPU>.json (`--out-dir` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench import common as bc
from bench import e2e_common as E
from bench import grpo_step as G


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", default="1,2", help="world sizes, one after the other")
    p.add_argument("--model", default="1b", help="1b, 8b (bench.e2e_common shapes) or tiny")
    p.add_argument("--model-cache", default=os.path.expanduser("~/.cache/grpo_lce/bench"))
    p.add_argument("--length", type=int, default=512, help="completion length L")
    p.add_argument("--generations", type=int, default=8, help="completions per rank and step")
    p.add_argument("--warmup", type=int, default=2, help="steps not counted (the compile)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--system", choices=("ours_loop", "ours"), default="ours_loop",
                   help="bench.grpo_step's system: the decode loop (the trainer's default "
                        "sampler) or the compiled FastSampler")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, args, out_file: str) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    from transformers import AutoTokenizer

    path = E.model_dir(args.model, args.model_cache)
    tok = AutoTokenizer.from_pretrained(path)
    model = E.load_model(path, device=args.device, quantize=cuda and args.model != "tiny",
                         gpu=rank)
    base = torch.cuda.memory_allocated() if cuda else 0
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        tr = G.build_trainer(args.system, model, tok, G=args.generations, L=args.length,
                             steps=steps, device=args.device, out=out)
        timer = G.PartTimer(cuda, base)
        G.attach(tr, timer)
        t0 = time.perf_counter()
        tr.train()
        train_s = time.perf_counter() - t0
    # the one-time cost of whichever sampler served: the decode loop's captures, or the
    # compiled sampler's compiles
    samplers = tr._lce_samplers
    fast = samplers.metrics()
    loop_off = samplers.loop_off or getattr(samplers.loop, "disabled_reason", None)
    rec = {"rank": rank, "world": world, "train_s": train_s,
           "step_s": [s["step"]["s"] for s in timer.steps],
           "generation_s": [s.get("generation", {}).get("s") for s in timer.steps],
           "compile_s": fast.get("fast_generation/capture_s", 0.0)
           + fast.get("fast_generation/compile_s", 0.0),
           "compiles": fast.get("fast_generation/captures", 0.0)
           + fast.get("fast_generation/compiles", 0.0),
           "sampler_calls": {k.split("/")[1]: v for k, v in fast.items() if k.endswith("_calls")},
           "sampler_off": loop_off,
           "device": str(next(model.parameters()).device),
           "loss": [h["loss"] for h in tr.state.log_history if "loss" in h]}
    with open(out_file, "a") as f:
        f.write(json.dumps(rec) + "\n")
    if dist.is_initialized():
        dist.barrier()


def _spawned(rank: int, world: int, args, port: int, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    run_rank(rank, world, args, out_file)
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned_one(_index: int, args, out_file: str) -> None:
    """World size 1 in a process of its own that sees one GPU (`_one_gpu_visible`)."""
    run_rank(0, 1, args, out_file)


@contextlib.contextmanager
def _one_gpu_visible(device: str):
    """CUDA_VISIBLE_DEVICES narrowed to the first GPU for the processes started inside: TRL
    refuses a process that sees several (Trainer would wrap the model in nn.DataParallel). Set
    before the child starts, since torch caches the device count at its first query, which an
    import can make."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = (saved or "0").split(",")[0]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def summarize(recs: list[dict], warmup: int) -> dict:
    steady = [statistics.median(r["step_s"][warmup:]) for r in recs]
    first = [r["step_s"][0] for r in recs]
    r0 = min(recs, key=lambda r: r["rank"])
    return {
        "world": r0["world"],
        "step_s": steady[recs.index(r0)],
        "step_s_per_rank": steady,
        "generation_s": statistics.median(x for x in r0["generation_s"][warmup:] if x),
        "compile_s_per_rank": [r["compile_s"] for r in recs],
        "wait_s_per_rank": [f - r["compile_s"] - s for f, r, s in zip(first, recs, steady)],
        "sampler_off": [r["sampler_off"] for r in recs],
        "sampler_calls": [r["sampler_calls"] for r in recs],
        "devices": [r["device"] for r in recs],
        "loss_rank0": r0["loss"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    E.model_dir(args.model, args.model_cache)  # built once, before the ranks load it
    results = []
    for world in [int(x) for x in args.nprocs.split(",")]:
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            out_file = f.name
        if world == 1:
            with _one_gpu_visible(args.device):
                torch.multiprocessing.spawn(_spawned_one, args=(args, out_file), nprocs=1)
        else:
            torch.multiprocessing.spawn(_spawned, args=(world, args, _free_port(), out_file),
                                        nprocs=world)
        recs = [json.loads(line) for line in Path(out_file).read_text().splitlines()]
        results.append(summarize(sorted(recs, key=lambda r: r["rank"]), args.warmup))
        r = results[-1]
        print(f"P={world}: step {r['step_s']:.2f} s (per rank {r['step_s_per_rank']}), "
              f"generation {r['generation_s']:.2f} s, compile {r['compile_s_per_rank']} s, "
              f"wait {r['wait_s_per_rank']} s, sampler calls {r['sampler_calls']}, "
              f"loop off: {r['sampler_off']}", flush=True)
    one = next((r for r in results if r["world"] == 1), None)
    for r in results:
        r["efficiency"] = None if one is None else one["step_s"] / r["step_s"]
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    env = bc.env_info(dev)
    for pkg in ("transformers", "trl", "peft", "accelerate", "bitsandbytes"):
        env[pkg] = bc.package_version(pkg)
    tag = bc.gpu_short_name(dev) if args.device == "cuda" else "cpu"
    suffix = ("" if args.model == "1b" else f"_{args.model}") + (
        "" if args.system == "ours_loop" else f"_{args.system}")
    path = Path(args.out_dir) / f"grpo_ddp_{tag}{suffix}.json"
    bc.write_json(path, {"args": vars(args), "env": env, "results": results})
    print("| GPUs | step s | generation s (rank 0) | compile s per rank | wait s per rank | "
          "scaling efficiency |\n|---|---|---|---|---|---|")
    for r in results:
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        print(f"| {r['world']} | {r['step_s']:.2f} | {r['generation_s']:.2f} | "
              f"{', '.join(f'{x:.1f}' for x in r['compile_s_per_rank'])} | "
              f"{', '.join(f'{x:.1f}' for x in r['wait_s_per_rank'])} | {eff} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
