"""GRPO training-phase throughput of trainers.GRPOTrainer under DDP: N GPUs against 1 (scaling).

One step per rank = what GRPO does between generations for one micro-batch: the reference
log-prob pass (adapter disabled, no grad) and `compute_loss` + backward through the DDP wrapper
(β = 0.04, so the reference log-probs enter the loss; loss_type dapo). Each rank scores its own
synthetic ragged batch of G completions of up to L tokens after a 64-token prompt (56 % mean
fill at G=8, as bench.e2e_common.grpo_batch builds it). Model: Llama-3.2-1B shape (hidden
2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256, tied), random init, NF4 4-bit with
double quantization and bf16 compute, LoRA r=16 on all linear layers, gradient checkpointing.

Reported per world size P: median step ms (20-80 % spread) on rank 0, measured between two
barriers so the slowest rank and the gradient all-reduce are inside; tokens/s over all ranks
(attention-mask tokens, prompt included, and completion tokens alone); peak GPU memory; and the
scaling efficiency tokens/s(P) / (P · tokens/s(1)) when both runs are in bench/results/.

Two GPUs (from the project root; each command writes its JSON, the second also the .md table):

    torchrun --nproc_per_node 1 -m bench.ddp
    torchrun --nproc_per_node 2 -m bench.ddp

or both in one go, spawning the ranks itself:  python3 -m bench.ddp --nprocs 1,2
Longer completions:  torchrun --nproc_per_node 2 -m bench.ddp --lengths 1024,4096

CPU smoke run (tiny fp32 Llama, gloo, no quantization; checks the plumbing, not the speed):

    python3 -m bench.ddp --tiny --device cpu --nprocs 1,2

Writes bench/results/bench_ddp_<GPU>_<P>proc.json (one per world size) and bench_ddp_<GPU>.md
(`_tiny` in the names for --tiny runs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import RESULTS_DIR, env_info, gpu_short_name, package_version
from bench.e2e_common import (
    grpo_batch,
    lora_config,
    model_dir,
    prepare_for_direct_calls,
    summarize,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", default="1",
                   help="world sizes to run one after the other, spawning the ranks (e.g. 1,2); "
                        "ignored under torchrun, which sets the world size")
    p.add_argument("--lengths", default="1024", help="completion lengths L, comma-separated")
    p.add_argument("--generations", type=int, default=8, help="G completions per rank and step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per length")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per length")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo smoke run")
    p.add_argument("--tiny", action="store_true",
                   help="tiny fp32 Llama (trainers.tiny), no 4-bit: a plumbing check")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/grpo_lce"),
                   help="where the random 1B-shaped model is saved on first use")
    p.add_argument("--port", type=int, default=0,
                   help="rendezvous port when spawning (default: a free one)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu for the smoke run)")
    if args.tiny:
        args.lengths = args.lengths if args.lengths != "1024" else "32"
    return args


def _log(*a):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*a, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _zero_reward(completions, **_):
    return [0.0] * len(completions)  # never called: the benchmark does not generate


def build_trainer(args, rank: int, world: int, local_rank: int, device):
    import trl
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainers import GRPOTrainer

    name = "tiny" if args.tiny else "1b"
    if rank == 0:
        path = model_dir(name, args.cache)  # rank 0 builds the random model once
    if world > 1:
        dist.barrier()
    path = model_dir(name, args.cache)
    kw: dict = {"attn_implementation": "sdpa"}
    if device.type == "cuda" and not args.tiny:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kw["dtype"] = torch.bfloat16
        kw["device_map"] = {"": local_rank}  # each rank its own GPU
    else:
        kw["dtype"] = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    if device.type == "cuda" and args.tiny:
        model.to(device)
    model = get_peft_model(model, lora_config())
    G = args.generations
    config = trl.GRPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "bench_ddp"), report_to="none",
        save_strategy="no",
        use_cpu=device.type == "cpu", bf16=device.type == "cuda", beta=0.04, loss_type="dapo",
        per_device_train_batch_size=G, num_generations=G, max_completion_length=64, seed=0,
    )
    tok = AutoTokenizer.from_pretrained(path)
    tr = GRPOTrainer(model=model, reward_funcs=_zero_reward,
                     args=config, train_dataset=Dataset.from_dict({"prompt": ["x"] * G}),
                     processing_class=tok)
    prepare_for_direct_calls(tr, checkpointing=True)  # what Trainer.train() sets up
    wrapped = tr.accelerator.prepare_model(tr.model)  # DDP when world > 1, as Trainer.train does
    return tr, wrapped


def make_inputs(tr, ids, mask, L):
    """The training-phase inputs of one micro-batch, with the reference pass inside (timed)."""
    from trl.trainer.utils import use_adapter

    P = ids.shape[1] - L
    with torch.no_grad(), use_adapter(tr.model, adapter_name=None):
        ref, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, L)
    n = mask[:, P:].sum()
    dist_n = n.clone()
    if dist.is_initialized():
        dist.all_reduce(dist_n)  # TRL gathers num_items_in_batch over processes
    G = ids.shape[0]
    return {
        "prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P],
        "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
        "advantages": torch.linspace(-1, 1, G, device=ids.device),
        "ref_per_token_logps": ref, "num_items_in_batch": dist_n,
    }


def run_rank(rank: int, world: int, args) -> dict | None:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                rank=rank, world_size=world)
    tr, wrapped = build_trainer(args, rank, world, local_rank, device)
    V = tr.model.config.vocab_size if hasattr(tr.model, "config") else None
    rows = []
    for L in [int(x) for x in args.lengths.split(",")]:
        samples, tokens, completion_tokens = [], 0, 0
        for step in range(args.warmup + args.steps):
            ids, mask = grpo_batch(args.generations, L, V, str(device),
                                   seed=1000 * rank + step)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if world > 1:
                dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            inputs = make_inputs(tr, ids, mask, L)
            wrapped.zero_grad(set_to_none=True)
            loss = tr.compute_loss(wrapped, inputs)
            loss.backward()
            _sync(device)
            if world > 1:
                dist.barrier()  # the step ends when the slowest rank's all-reduce is done
            ms = (time.perf_counter() - t0) * 1e3
            if step < args.warmup:
                continue
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            samples.append((ms, peak, peak))
            counts = torch.stack([mask.sum(), mask[:, -L:].sum()]).to(device)
            if world > 1:
                dist.all_reduce(counts)
            tokens += int(counts[0])
            completion_tokens += int(counts[1])
        s = summarize(samples)
        secs = sum(x[0] for x in samples) / 1e3
        row = {
            "world_size": world, "L": L, "G_per_rank": args.generations, **s,
            "tokens_per_s": tokens / secs, "completion_tokens_per_s": completion_tokens / secs,
            "peak_gib": None if s["total_bytes"] is None else s["total_bytes"] / 2**30,
        }
        rows.append(row)
        _log(f"P={world} L={L}: {s['ms']:.1f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
             f"{row['completion_tokens_per_s']:.0f} completion tok/s")
    if world > 1:
        dist.barrier()
    return rows if rank == 0 else None


def _tag(args, device) -> str:
    return gpu_short_name(device) + ("_tiny" if args.tiny else "")


def write_results(args, world: int, rows: list[dict]) -> None:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tag = _tag(args, device)
    env = env_info(device)
    env.update(world_size=world, trl=package_version("trl"), transformers=package_version(
        "transformers"), peft=package_version("peft"), bitsandbytes=package_version(
        "bitsandbytes"), model="tiny" if args.tiny else "llama-1b-shape nf4 lora r16 ckpt")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"bench_ddp_{tag}_{world}proc.json").write_text(
        json.dumps({"env": env, "rows": rows}, indent=1, default=str) + "\n")
    write_markdown(tag)


def write_markdown(tag: str) -> Path:
    """One table from every bench_ddp_<tag>_<P>proc.json present, efficiency against P=1."""
    runs = {}
    for f in sorted(RESULTS_DIR.glob(f"bench_ddp_{tag}_*proc.json")):
        data = json.loads(f.read_text())
        for r in data["rows"]:
            runs[(r["L"], r["world_size"])] = (r, data["env"])
    lines = [f"# bench_ddp: GRPO training phase (ref pass + loss fwd/bwd), DDP, {tag}", "",
             "| L | GPUs | ms/step (p20-p80) | tokens/s | completion tok/s | per GPU tok/s | "
             "scaling eff. | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for (L, P), (r, env) in sorted(runs.items()):
        base = runs.get((L, 1))
        eff = (f"{100 * r['tokens_per_s'] / (P * base[0]['tokens_per_s']):.0f} %"
               if base is not None else "n/a")
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {L} | {P} | {r['ms']:.1f} ({r['p20']:.1f}-{r['p80']:.1f}) | "
            f"{r['tokens_per_s']:.0f} | {r['completion_tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / P:.0f} | {eff} | {peak} |")
    any_env = next(iter(runs.values()))[1] if runs else {}
    lines += ["", f"{any_env.get('gpu') or any_env.get('cpu')}, torch {any_env.get('torch')}, "
              f"trl {any_env.get('trl')}, {any_env.get('model')}; G per rank "
              f"{next(iter(runs.values()))[0]['G_per_rank'] if runs else '?'}, "
              f"each rank its own batch (weak scaling)."]
    path = RESULTS_DIR / f"bench_ddp_{tag}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _spawned(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    rows = run_rank(rank, world, args)
    if rank == 0:
        write_results(args, world, rows)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rows = run_rank(rank, world, args)
        if rank == 0:
            write_results(args, world, rows)
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    for world in [int(x) for x in args.nprocs.split(",")]:
        if world == 1:
            _spawned(0, 1, args)
            continue
        if not args.port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                args.port = sock.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(world, args), nprocs=world)
        args.port = 0 if args.port else args.port
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    print(f"wrote {RESULTS_DIR}/bench_ddp_{_tag(args, device)}.md")


if __name__ == "__main__":
    main()
