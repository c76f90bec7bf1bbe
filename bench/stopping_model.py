"""A model that stops: samplers timed on ragged batches, and the sampler-trainer mismatch, on a
small Llama trained on the GPU inside the benchmark so that it ends its answers with EOS at
varied lengths and its next-token distributions are peaked (a random-init model never emits
EOS and has near-flat distributions, so it measures neither).

The task and the model (bench.stopping_task): chains of tokens, each answer the rest of a
chain then EOS, so answers end at every length up to --max-chain (480) and the next token is a
bigram map a small Llama learns in a few hundred SFT steps (--sft-steps of --sft-batch
sequences). --shape "4l" (default): the Llama-3.2-1B shape with 4 layers (Llama-3 vocabulary
128256); "1b": all 16 layers. Sampled as a GRPO trainer holds it: --base nf4 (default) or bf16,
with LoRA r = 16 on every linear layer (B = 0 at init), TRL's sampling settings (temperature 1,
top_p 1, top_k 0) and max_new_tokens = --new (512).

(a) Ragged-batch timing, batch 8 and 64, per sampler:

    loop      trainers.sampling.loop.DecodeLoop (our decode loop)
    loop_compact  the same with finished rows compacted out of the batch (compact_finished;
              --compact adds it after loop): its stats give the compactions, the working
              batches used and the row decode steps saved
    compiled  trainers.generation.FastSampler (static cache, compiled decode step)
    eager     model.generate, dynamic cache (what TRL 1.16 runs)

    first call s (compile / capture included), then the median of --reps calls: wall s, the
    batch's decode steps (its longest answer), ms per decode step, of which inside CUDA-graph
    replays (bench.graph_time) and outside; answer lengths (mean / max, share ending in EOS);
    tokens per second; peak memory above what was allocated before the sampler's first call
    (the loaded model, and nothing of the samplers run before it: each is dropped with its
    caches, graphs and compiled code). For the loop also its own stats per call (prefill_s,
    decode_s, steps, host_checks) and capture_s.

(b) Mismatch against the trainer's exact log-probs, for the loop (and loop_compact) and for
    eager `generate`: --mismatch-calls calls of batch 64; each sampled token's log-prob as the
    sampler reports it (the loop: `Completions.logprobs`; eager: log_softmax of the scores it
    sampled from, `EagerLogprobs`) against the trainer's on the same sequences (TRL's layout, the
    backbone under bf16 autocast, then grpo_lce.linear_logprobs at temperature 1 in fp32, as
    `trainers.GRPOTrainer` computes `old_per_token_logps`). Δ = sampler − trainer over the
    answer tokens: mean |Δ|, max |Δ|, and the KL per token from the samples, KL(sampler ‖
    trainer) = E_sampler[Δ] (k1) and E[exp(−Δ) − 1 + Δ] (k3, non-negative); the mean −log p
    (trainer's) shows how peaked the distributions are.

    python -m bench.stopping_model --quick            # ~4 min on an H100
    python -m bench.stopping_model --quick --samplers loop --compact --tag _compact
    python -m bench.stopping_model                    # ~6 min: more SFT steps and repeats
    python -m bench.stopping_model --base bf16 --tag _bf16
    python -m bench.stopping_model --tiny --device cpu   # smoke run (eager only)

Writes bench/results/stopping_model_<GPU>[<tag>].json (environment, training curve, both
tables' rows) and .md (the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import common as bc
from bench.graph_time import GraphReplayTimer
from bench.stopping_task import (
    EOS,
    PAD,
    SHAPES,
    ChainTask,
    build_model,
    generation_config,
    left_padded,
    sampling_model,
    train_sft,
    trimmed,
)

SAMPLERS = ("loop", "loop_compact", "compiled", "eager")
DEFAULT_SAMPLERS = ("loop", "compiled", "eager")


# =========================================================================== samplers


class EagerLogprobs:
    """A logits processor that keeps each sampled token's log-prob under the processed scores
    it was drawn from, holding one step's (B, V) scores at a time (storing every step's scores
    would take B · new · V · 4 bytes); the token sampled after call t is read at call t + 1.

    transformers appends a custom processor after its own processors but before the sampling
    warpers (temperature, top-k, top-p, min-p), so the scores seen here are the sampled-from
    ones only when no warper acts: `check_config` refuses a config where one would.
    """

    @staticmethod
    def check_config(cfg) -> None:
        active = {k: v for k, v in (("temperature", cfg.temperature), ("top_k", cfg.top_k),
                                    ("top_p", cfg.top_p), ("min_p", cfg.min_p))
                  if v not in (None, 1.0, 0) or (k == "temperature" and v not in (None, 1.0))}
        if active:
            raise ValueError(f"EagerLogprobs reads the scores before the sampling warpers, so "
                             f"it needs them inactive; got {active}")

    def __init__(self):
        self.prev: torch.Tensor | None = None  # (B, V) fp32, the last step's scores
        self.steps: list[torch.Tensor] = []  # (B,) per step

    def _resolve(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            lp = self.prev.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
            self.steps.append(lp)
            self.prev = None

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self._resolve(input_ids[:, -1])
        self.prev = scores.float()
        return scores

    def finish(self, sequences: torch.Tensor, prompt_len: int) -> list[list[float]]:
        self._resolve(sequences[:, -1])
        lps = torch.stack(self.steps, 1).tolist()  # (B, S)
        ids = trimmed(sequences[:, prompt_len:].cpu())
        return [lp[:len(row)] for lp, row in zip(lps, ids)]


class Sampler:
    """One sampler's `sample(model, ids, mask, cfg) -> (token lists, log-probs or None)`."""

    def __init__(self, name: str, device: str):
        self.name, self.obj, self.off = name, None, None
        if name in ("loop", "loop_compact"):
            try:
                from trainers.sampling.loop import DecodeLoop

                self.obj = DecodeLoop(devices=(device,), compact_finished=name == "loop_compact")
            except Exception as exc:  # noqa: BLE001 - recorded as n/a
                self.off = bc.short_error(exc)
        elif name == "compiled":
            from trainers.generation import FastSampler

            self.obj = FastSampler(devices=(device,))

    def stats(self) -> dict:
        return dict(vars(self.obj.stats)) if self.obj is not None else {}

    @torch.no_grad()
    def sample(self, model, ids, mask, cfg, want_logprobs=False):
        if self.off is not None:
            return None, None
        if self.name in ("loop", "loop_compact"):
            reason = self.obj.disabled_reason or self.obj.unsupported_reason(model, cfg)
            out = None if reason else self.obj.generate(model, ids, mask, cfg)
            if out is None:
                self.off = reason or self.obj.disabled_reason or "declined"
                return None, None
            return out.token_ids, out.logprobs
        if self.name == "compiled":
            seq = self.obj.generate(model, ids, mask, cfg)
            if seq is None:
                self.off = self.obj.disabled_reason or "declined"
                return None, None
            return trimmed(seq[:, ids.size(1):].cpu()), None
        if not want_logprobs:
            seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            return trimmed(seq[:, ids.size(1):].cpu()), None
        from transformers import LogitsProcessorList

        EagerLogprobs.check_config(cfg)
        keep = EagerLogprobs()
        seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                             logits_processor=LogitsProcessorList([keep]))
        return trimmed(seq[:, ids.size(1):].cpu()), keep.finish(seq, ids.size(1))


# =========================================================================== (a) timing


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_call(sampler: Sampler, model, ids, mask, cfg, device) -> dict | None:
    before = sampler.stats()
    sync(device)
    t0 = time.perf_counter()
    with GraphReplayTimer() as graphs:
        token_ids, _ = sampler.sample(model, ids, mask, cfg)
    sync(device)
    wall = time.perf_counter() - t0
    if token_ids is None:
        return None
    lens = [len(r) for r in token_ids]
    after = sampler.stats()
    delta = {k: after[k] - (before.get(k) or 0) for k in after
             if isinstance(after[k], (int, float)) and not isinstance(after[k], bool)}
    return {"wall_s": wall, "steps": max(lens), "tokens": sum(lens),
            "mean_len": statistics.mean(lens), "max_len": max(lens),
            "eos_share": sum(r[-1] == EOS for r in token_ids if r) / len(lens),
            "graph_s": graphs.seconds(), "replays": graphs.replays, "stats_delta": delta}


def timing(model, task, names, batches, reps, cfg, device, base_bytes) -> list[dict]:
    rows = []
    for B in batches:
        rng = random.Random(1000 + B)
        ids, mask = left_padded([task.example(rng)[0] for _ in range(B)], device)
        for name in names:
            sampler = Sampler(name, device)
            if device == "cuda":
                bc.free_memory()
                torch.cuda.reset_peak_memory_stats()
                # what an earlier sampler still holds is not this one's
                before = torch.cuda.memory_allocated()
            torch.manual_seed(0)
            first = timed_call(sampler, model, ids, mask, cfg, device)
            calls = [timed_call(sampler, model, ids, mask, cfg, device)
                     for _ in range(reps)] if first is not None else []
            row = {"batch": B, "sampler": name}
            if first is None or any(c is None for c in calls):
                row["status"] = f"n/a: {sampler.off}"
                rows.append(row)
                print(f"  [{name} B={B}] {row['status']}", flush=True)
                release(sampler, model)
                continue
            med = {k: statistics.median(c[k] for c in calls)
                   for k in ("wall_s", "steps", "tokens", "mean_len", "max_len", "eos_share",
                             "graph_s", "replays")}
            ms_step = [1e3 * c["wall_s"] / c["steps"] for c in calls]
            in_graph = [1e3 * c["graph_s"] / c["steps"] for c in calls]
            row.update(status="ok", first_call_s=first["wall_s"], **med,
                       ms_per_step=statistics.median(ms_step),
                       ms_in_graphs=statistics.median(in_graph),
                       tokens_per_s=statistics.median(c["tokens"] / c["wall_s"] for c in calls),
                       calls=calls, first=first, stats=sampler.stats())
            row["ms_outside"] = row["ms_per_step"] - row["ms_in_graphs"]
            if device == "cuda":
                row["peak_above_model_bytes"] = torch.cuda.max_memory_allocated() - before
                row["held_before_bytes"] = before - base_bytes
            rows.append(row)
            print(f"  [{name} B={B}] first {first['wall_s']:.1f} s, {row['wall_s']:.2f} s/call, "
                  f"{row['ms_per_step']:.2f} ms/step ({row['ms_in_graphs']:.2f} in graphs), "
                  f"mean len {row['mean_len']:.0f}, max {row['max_len']}"
                  + compaction_line(row), flush=True)
            release(sampler, model)
    return rows


def compaction_line(row: dict) -> str:
    """The loop's compaction per call (medians of the repeated calls), or ""."""
    calls = row.get("calls") or []
    if row.get("sampler") != "loop_compact" or not calls:
        return ""
    d = [c["stats_delta"] for c in calls]
    med = {k: statistics.median(x.get(k, 0) for x in d)
           for k in ("compactions", "compacted_rows", "row_steps_saved", "steps")}
    return (f"; per call {med['compactions']:.0f} compactions, {med['compacted_rows']:.0f} rows "
            f"dropped, {med['row_steps_saved']:.0f} of {row['batch'] * med['steps']:.0f} row "
            f"steps saved; working batches {row['stats'].get('buckets')}, "
            f"{row['stats'].get('captures')} graphs")


def release(sampler: Sampler, model) -> None:
    """Drop a sampler with its caches, graphs and compiled code before the next one runs."""
    sampler.obj = None
    model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("_last_compile_config", None)
    torch.compiler.reset()
    bc.free_memory()


# =========================================================================== (b) mismatch


@torch.no_grad()
def trainer_logprobs(model, ids, mask, completions, device) -> list[list[float]]:
    """The trainer's exact log-probs of `completions` after the left-padded prompts (TRL's
    layout: completions right-padded), as trainers.GRPOTrainer computes them."""
    from trainers.head import forward_hidden_states, head_logprobs, lm_head_params

    P, K = ids.size(1), max(map(len, completions))
    comp = torch.full((len(completions), K), PAD, dtype=torch.long)
    cmask = torch.zeros(len(completions), K, dtype=torch.long)
    for i, row in enumerate(completions):
        comp[i, :len(row)] = torch.tensor(row)
        cmask[i, :len(row)] = 1
    comp, cmask = comp.to(device), cmask.to(device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else (
        contextlib.nullcontext())
    with amp:
        hidden, _ = forward_hidden_states(model, input_ids=torch.cat([ids, comp], 1),
                                          attention_mask=torch.cat([mask, cmask], 1))
    h = hidden[:, P - 1:P - 1 + K]  # position t predicts token t+1
    y = comp.masked_fill(cmask == 0, -100)
    weight, bias = lm_head_params(model)
    logp = head_logprobs(h, weight, bias, y, temperature=1.0)  # (B, K) fp32
    return [lp[:len(row)] for lp, row in zip(logp.tolist(), completions)]


def mismatch(model, task, names, batch, calls, cfg, device) -> list[dict]:
    rows = []
    for name in names:
        sampler = Sampler(name, device)
        deltas, exact_all, lens, eos = [], [], [], 0
        for c in range(calls):
            rng = random.Random(5000 + c)
            ids, mask = left_padded([task.example(rng)[0] for _ in range(batch)], device)
            torch.manual_seed(c)
            token_ids, logps = sampler.sample(model, ids, mask, cfg, want_logprobs=True)
            if token_ids is None:
                break
            exact = trainer_logprobs(model, ids, mask, token_ids, device)
            for s_row, e_row, t_row in zip(logps, exact, token_ids):
                deltas += [s - e for s, e in zip(s_row, e_row)]
                exact_all += e_row
                lens.append(len(t_row))
                eos += bool(t_row) and t_row[-1] == EOS
        if not deltas:
            rows.append({"sampler": name, "status": f"n/a: {sampler.off}"})
            print(f"  [{name}] n/a: {sampler.off}", flush=True)
            continue
        d = torch.tensor(deltas, dtype=torch.float64)
        row = {"sampler": name, "status": "ok", "tokens": len(deltas),
               "sequences": len(lens), "mean_len": statistics.mean(lens),
               "eos_share": eos / len(lens),
               "mean_abs_dlogp": d.abs().mean().item(), "max_abs_dlogp": d.abs().max().item(),
               "kl_k1": d.mean().item(), "kl_k3": (torch.exp(-d) - 1 + d).mean().item(),
               "mean_nll": -statistics.mean(exact_all)}
        rows.append(row)
        print(f"  [{name}] mean |Δ| {row['mean_abs_dlogp']:.3g}, max {row['max_abs_dlogp']:.3g},"
              f" KL k3 {row['kl_k3']:.3g}, mean -log p {row['mean_nll']:.3g}", flush=True)
    return rows


# =========================================================================== report


def markdown(rec: dict) -> str:
    env, cfg = rec["env"], rec["config"]
    out = [(f"# bench.stopping_model on {env.get('gpu') or 'cpu'}: {cfg['shape']} shape, "
           f"{cfg['base']} base + LoRA, max_new_tokens {cfg['new']}"), "",
           (f"SFT: {cfg['sft_steps']} steps of {cfg['sft_batch']} sequences, final loss "
           f"{rec['sft'][-1]['loss']:.4f} ({rec['sft'][-1]['s']:.0f} s); commit {env['commit']}"),
           "", "## Ragged-batch timing (medians of the repeated calls)", "",
           ("| batch | sampler | first call s | s / call | decode steps | ms / step | in graphs"
           " | outside | mean len | max len | EOS share | tokens / s | peak above model GiB |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec["timing"]:
        if r["status"] != "ok":
            out.append(f"| {r['batch']} | {r['sampler']} | {r['status']} |" + " |" * 10)
            continue
        peak = r.get("peak_above_model_bytes")
        out.append(
            f"| {r['batch']} | {r['sampler']} | {r['first_call_s']:.1f} | {r['wall_s']:.2f} "
            f"| {r['steps']:.0f} | {r['ms_per_step']:.2f} | {r['ms_in_graphs']:.2f} "
            f"| {r['ms_outside']:.2f} | {r['mean_len']:.0f} | {r['max_len']:.0f} "
            f"| {r['eos_share']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {'' if peak is None else f'{peak / 2**30:.2f}'} |")
    compaction = [f"- batch {r['batch']}{compaction_line(r)}" for r in rec["timing"]
                  if r["status"] == "ok" and compaction_line(r)]
    if compaction:
        out += ["", "loop_compact (finished rows compacted out of the batch):", *compaction]
    out += ["", "## Sampler-trainer mismatch (Δ = sampler log p − trainer log p, per token)", "",
            ("| sampler | tokens | mean len | EOS share | mean abs Δ | max abs Δ | KL k1 | KL k3 "
            "| mean −log p |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rec["mismatch"]:
        if r["status"] != "ok":
            out.append(f"| {r['sampler']} | {r['status']} |" + " |" * 7)
            continue
        out.append(f"| {r['sampler']} | {r['tokens']} | {r['mean_len']:.0f} "
                   f"| {r['eos_share']:.2f} | {r['mean_abs_dlogp']:.3g} "
                   f"| {r['max_abs_dlogp']:.3g} | {r['kl_k1']:.3g} | {r['kl_k3']:.3g} "
                   f"| {r['mean_nll']:.3g} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="4l")
    p.add_argument("--base", choices=("nf4", "bf16"), default="nf4")
    p.add_argument("--new", type=int, default=512, help="max_new_tokens")
    p.add_argument("--chain-tokens", type=int, default=4096)
    p.add_argument("--min-chain", type=int, default=8)
    p.add_argument("--max-chain", type=int, default=480)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batches", default="8,64")
    p.add_argument("--samplers", default=",".join(DEFAULT_SAMPLERS),
                   help=f"comma list of {','.join(SAMPLERS)}")
    p.add_argument("--compact", action="store_true",
                   help="also time loop_compact (the loop compacting finished rows) after loop")
    p.add_argument("--reps", type=int, default=3, help="timed calls after the first")
    p.add_argument("--mismatch-calls", type=int, default=2, help="calls of batch 64")
    p.add_argument("--quick", action="store_true", help="250 SFT steps, 2 timed calls, 1 "
                   "mismatch call")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy for a CPU smoke run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    if a.quick:
        a.sft_steps, a.reps, a.mismatch_calls = 250, 2, 1
    if a.tiny:
        a.shape, a.base, a.new, a.chain_tokens = "tiny", "bf16", 24, 256
        a.min_chain, a.max_chain, a.sft_steps, a.sft_batch = 4, 20, 30, 8
        a.batches, a.reps, a.mismatch_calls = "2,4", 1, 1
        a.tag = a.tag or "_tiny"
    names = a.samplers.split(",")
    if a.compact and "loop_compact" not in names:
        names.insert(names.index("loop") + 1 if "loop" in names else 0, "loop_compact")
    for n in names:
        if n not in SAMPLERS:
            p.error(f"--samplers: unknown sampler {n!r} (choose from {SAMPLERS})")
    batches = [int(x) for x in a.batches.split(",")]
    device = a.device
    env = bc.env_info(torch.device(device))
    for pkg in ("transformers", "peft", "bitsandbytes", "trl"):
        env[pkg] = bc.package_version(pkg)
    t_start = time.perf_counter()

    task = ChainTask.make(SHAPES[a.shape]["vocab_size"], a.chain_tokens, a.min_chain,
                          a.max_chain)
    print(f"model {a.shape}, {len(task.chains)} chains; SFT {a.sft_steps} steps", flush=True)
    model = build_model(a.shape, device)
    curve = train_sft(model, task, steps=a.sft_steps, batch=a.sft_batch, lr=a.lr, device=device)
    with tempfile.TemporaryDirectory() as workdir:
        model = sampling_model(model, a.base, device, workdir)
    bc.free_memory()
    base_bytes = torch.cuda.memory_allocated() if device == "cuda" else 0
    cfg = generation_config(a.new)

    print("(a) ragged-batch timing", flush=True)
    timing_rows = timing(model, task, names, batches, a.reps, copy.deepcopy(cfg), device,
                         base_bytes)
    print("(b) mismatch against the trainer's log-probs", flush=True)
    mismatch_rows = mismatch(model, task, [n for n in ("loop", "loop_compact", "eager")
                                           if n in names],
                             max(batches), a.mismatch_calls, copy.deepcopy(cfg), device)

    rec = {"env": env, "config": {**vars(a), "chains": len(task.chains)}, "sft": curve,
           "timing": timing_rows, "mismatch": mismatch_rows,
           "total_s": time.perf_counter() - t_start}
    stem = Path(a.out_dir) / f"stopping_model_{bc.gpu_short_name(torch.device(device))}{a.tag}"
    bc.write_json(stem.with_suffix(".json"), rec)
    md = markdown(rec)
    stem.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {stem}.json and .md ({rec['total_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
