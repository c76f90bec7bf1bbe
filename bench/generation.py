"""On-policy sampling: decode speed and correctness of `trainers.generation.FastSampler`
against the eager `generate` TRL uses, on Llama-shaped NF4 + LoRA models (random init).

Parts (--parts):

    decode   ms per decode step at batch --batch after a --prompt-token prompt, --new sampled
             tokens, TRL's sampling settings (temperature 1, top_p 1, top_k 0), per variant:
               trl_dynamic   model.generate, dynamic cache, eager (what TRL 1.16 does)
               trl_static    the same with cache_implementation="static" (TRL's option; TRL
                             turns transformers' auto-compile off, so it stays eager)
               ours          FastSampler: static cache reused across calls, decode step compiled
                             by inductor with CUDA graphs (mode "reduce-overhead")
               ours_cudagraphs  FastSampler with dynamo's "cudagraphs" backend (CUDA graphs of
                             the traced aten graph, no inductor): shorter compile, no fusion
             decode ms/step = (t(new) - t(1)) / (new - 1), median of --reps; the first call's
             wall time (compile and capture for ours); generation's peak memory above the
             loaded model (the static cache included).
    checks   on the same model with its final norm scaled by --peak-scale (peaked next-token
             distributions, so greedy choices are not decided by rounding):
               greedy    token identity of greedy completions, ours against eager, for --batch
                         prompts of ragged lengths; max |Δ log p| of the chosen tokens where
                         the prefixes agree, next to eager's own |Δ log p| between batch
                         --batch and batch 1;
               sampling  mean log p per token of sampled completions (TRL's settings and a
                         top_k/top_p variant), ours against eager: the difference in units of
                         its standard error;
               weights   a greedy completion before and after an in-place SGD step on the
                         LoRA weights: ours must follow the update (equal eager's new one).

    python -m bench.generation --models 1b                  # both parts, ~4 min on an H100
    python -m bench.generation --models 1b,8b --parts decode

Writes bench/results/generation_<GPU>.json and .md (a table per part).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import torch

from bench import common as bc
from bench import e2e_common as E

VARIANTS = ("trl_dynamic", "trl_static", "ours", "ours_cudagraphs")


def trl_generation_config(new_tokens: int, **overrides):
    """The GenerationConfig TRL 1.16's GRPOTrainer builds with its default sampling options."""
    from transformers import GenerationConfig

    kw = dict(max_new_tokens=new_tokens, do_sample=True, pad_token_id=0, bos_token_id=1,
              eos_token_id=[2], temperature=1.0, top_p=1.0, top_k=0, min_p=None,
              repetition_penalty=1.0, cache_implementation=None)
    kw.update(overrides)
    return GenerationConfig(**kw, disable_compile=True)


DEVICE = "cuda"  # "cpu" for the smoke run (--tiny --device cpu)


def load_policy(name: str, cache_dir: str):
    """NF4 base + LoRA r=16 on all linear layers, adapters in bf16 as TRL's QLoRA set-up (on
    CUDA); the fp32 tiny model + LoRA on CPU."""
    from peft import get_peft_model

    cuda = DEVICE == "cuda"
    model = E.load_model(E.model_dir(name, cache_dir), device=DEVICE, quantize=cuda)
    model = get_peft_model(model, E.lora_config())
    for p in model.parameters():
        if p.requires_grad and cuda:
            p.data = p.data.to(torch.bfloat16)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():  # LoRA B is zero at init; give the adapter an effect
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device=DEVICE, dtype=p.dtype) * 0.02)
    return model


def sampler(backend: str = "inductor"):
    from transformers.generation.configuration_utils import CompileConfig

    from trainers.generation import FastSampler

    if DEVICE == "cpu":  # the smoke run: dynamo without a code generator, forced onto the CPU
        cfg = CompileConfig(fullgraph=False, dynamic=False, backend="aot_eager", mode=None)
        cfg._compile_all_devices = True
        return FastSampler(cfg, devices=("cpu",))
    if backend == "inductor":
        return FastSampler()
    return FastSampler(CompileConfig(fullgraph=False, dynamic=False, backend=backend, mode=None))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts(batch: int, lengths, V: int, seed: int = 0):
    """Left-padded (ids, mask) of `batch` random prompts with the given lengths."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(batch, P, dtype=torch.long)
    mask = torch.zeros(batch, P, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, V, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


class Generator:
    """One variant's `generate(ids, mask, config)`."""

    def __init__(self, variant: str, model):
        self.variant, self.model = variant, model
        self.sampler = None
        if variant == "ours":
            self.sampler = sampler()
        elif variant == "ours_cudagraphs":
            self.sampler = sampler("cudagraphs")

    @torch.no_grad()
    def __call__(self, ids, mask, config, **extra):
        cfg = copy.deepcopy(config)
        if self.variant == "trl_static":
            cfg.cache_implementation = "static"
        for k, v in extra.items():
            setattr(cfg, k, v)
        if self.sampler is None:
            return self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        out = self.sampler.generate(self.model, ids, mask, cfg)
        if out is None:
            raise RuntimeError(f"FastSampler off: {self.sampler.disabled_reason}")
        return out


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def memory_allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def decode_part(name: str, a) -> list[dict]:
    model = load_policy(name, a.model_cache)
    V = model.config.vocab_size
    ids, mask = prompts(a.batch, [a.prompt_tokens] * a.batch, V)
    rows = []
    for variant in a.variants:
        bc.free_memory()
        base = memory_allocated()
        gen = Generator(variant, model)
        cfg_n, cfg_1 = trl_generation_config(a.new), trl_generation_config(1)
        rec = {"model": name, "variant": variant, "batch": a.batch, "prompt": a.prompt_tokens,
               "new": a.new}
        try:
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rec["first_call_s"] = timed(lambda: gen(ids, mask, cfg_n))
            t_n = [timed(lambda: gen(ids, mask, cfg_n)) for _ in range(a.reps)]
            gen(ids, mask, cfg_1)  # untimed: a 1-token call has its own cache, hence warm-up
            t_1 = [timed(lambda: gen(ids, mask, cfg_1)) for _ in range(a.reps)]
            rec["peak_extra_bytes"] = (torch.cuda.max_memory_allocated() - base
                                       if DEVICE == "cuda" else 0)
            rec["ms_per_step"] = (1e3 * (statistics.median(t_n) - statistics.median(t_1))
                                  / (a.new - 1))
            rec["call_s"] = statistics.median(t_n)
            rec["calls_s"] = t_n
            if gen.sampler is not None:
                rec["sampler"] = vars(gen.sampler.stats).copy()
            rec["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded, the next variant runs
            rec["status"] = bc.short_error(exc, 300)
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        gen = None  # the sampler's cache and graphs go before the next variant
    del model
    bc.free_memory()
    return rows


def chosen_logp(logits_steps, sequences, P):
    """(B, S) log p of the chosen token at each step, from generate's raw per-step logits."""
    out = []
    for s, lg in enumerate(logits_steps):
        lp = torch.log_softmax(lg.float(), -1)
        out.append(lp.gather(1, sequences[:, P + s, None])[:, 0])
    return torch.stack(out, 1)


def agreeing(a_seq, b_seq, P):
    """(B, S) mask: step s of row b has the same tokens before it in both sequences."""
    same = (a_seq[:, P:] == b_seq[:, P:]).long()
    prefix = torch.cumprod(same, 1)
    return torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], 1).bool()


def checks_part(name: str, a, save=lambda out: None) -> dict:
    """The three checks (module docstring); `save(out)` after each, so a run cut short keeps
    what it measured."""
    model = load_policy(name, a.model_cache)
    V = model.config.vocab_size
    with torch.no_grad():
        model.get_base_model().model.norm.weight.mul_(a.peak_scale)
    out: dict = {"model": name, "peak_scale": a.peak_scale}
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(24, 200, (a.batch,), generator=g).tolist()
    ids, mask = prompts(a.batch, lengths, V, seed=1)
    P = ids.shape[1]
    eager, ours = Generator("trl_dynamic", model), Generator("ours", model)
    greedy = trl_generation_config(a.check_new, do_sample=False)
    ret = dict(output_logits=True, return_dict_in_generate=True)

    # greedy identity, and |Δ log p| next to eager's own batch-size variation
    e = eager(ids, mask, greedy, **ret)
    o = ours(ids, mask, greedy, **ret)
    same_rows = (e.sequences == o.sequences).all(1)
    first_diff = [int((r != 0).nonzero()[0]) if r.any() else None
                  for r in (e.sequences[:, P:] != o.sequences[:, P:])]
    lp_e, lp_o = chosen_logp(e.logits, e.sequences, P), chosen_logp(o.logits, o.sequences, P)
    agree = agreeing(e.sequences, o.sequences, P)
    d_ours = (lp_e - lp_o).abs()[agree]
    singles = []
    for b in range(a.batch):
        keep = mask[b].bool()
        s = eager(ids[b:b + 1, keep], mask[b:b + 1, keep], greedy, **ret)
        Pb = int(keep.sum())
        seq = s.sequences
        lp_s = chosen_logp(s.logits, seq, Pb)
        agree_b = agreeing(e.sequences[b:b + 1, P:], seq[:, Pb:], 0)
        singles.append((lp_e[b:b + 1] - lp_s).abs()[agree_b])
    d_batch = torch.cat(singles)
    out["greedy"] = {
        "prompt_lengths": lengths, "new": a.check_new,
        "identical_rows": int(same_rows.sum()), "rows": a.batch,
        "first_difference_at": first_diff,
        "max_abs_dlogp_ours_vs_eager": float(d_ours.max()),
        "mean_abs_dlogp_ours_vs_eager": float(d_ours.mean()),
        "max_abs_dlogp_eager_batch_vs_single": float(d_batch.max()),
        "mean_abs_dlogp_eager_batch_vs_single": float(d_batch.mean()),
        "median_max_p": float(lp_e.exp().median()),
    }
    print(json.dumps(out["greedy"]), flush=True)
    save(out)

    # sampling: mean log p per token of samples, under the same (eager, unprocessed) model
    def sample_logp(gen, cfg, rounds, seed):
        torch.manual_seed(seed)
        means = []
        for r in range(rounds):
            seqs = gen(ids, mask, cfg)
            comp = seqs[:, P:]
            with torch.no_grad():
                logits = model(input_ids=seqs, attention_mask=torch.cat(
                    [mask, torch.ones_like(comp)], 1)).logits[:, P - 1:-1].float()
            lp = torch.log_softmax(logits / cfg.temperature, -1).gather(2, comp[..., None])[..., 0]
            means += lp.mean(1).tolist()
        return means

    out["sampling"] = []
    for label, cfg in (("trl_defaults", trl_generation_config(a.check_new)),
                       ("top_k_50_top_p_0.9_t_0.8",
                        trl_generation_config(a.check_new, top_k=50, top_p=0.9, temperature=0.8))):
        m_e = sample_logp(eager, cfg, a.sample_rounds, 10)
        m_o = sample_logp(ours, cfg, a.sample_rounds, 20)
        se = math.sqrt(statistics.variance(m_e) / len(m_e) + statistics.variance(m_o) / len(m_o))
        z = (statistics.mean(m_o) - statistics.mean(m_e)) / se
        rec = {"settings": label, "sequences": len(m_e), "mean_logp_eager": statistics.mean(m_e),
               "mean_logp_ours": statistics.mean(m_o), "stderr": se, "z": z}
        out["sampling"].append(rec)
        print(json.dumps(rec), flush=True)
        save(out)

    # weights: an in-place optimizer step must reach the compiled decode step
    before_o = ours(ids, mask, greedy)
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD(lora, lr=1.0)
    gen_ = torch.Generator(device=DEVICE).manual_seed(3)
    for p in lora:
        p.grad = torch.randn(p.shape, generator=gen_, device=DEVICE, dtype=p.dtype) * 0.05
    ptrs = [p.data_ptr() for p in lora]
    opt.step()
    assert ptrs == [p.data_ptr() for p in lora]  # the step is in place
    after_e, after_o = eager(ids, mask, greedy), ours(ids, mask, greedy)
    out["weights"] = {
        "rows_changed_by_step_eager": int((before_o != after_e).any(1).sum()),
        "rows_ours_equal_eager_after_step": int((after_o == after_e).all(1).sum()),
        "rows": a.batch, "sampler": vars(ours.sampler.stats).copy(),
        "sampler_off": ours.sampler.disabled_reason,
    }
    print(json.dumps(out["weights"]), flush=True)
    return out


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# bench.generation on {env.get('gpu')}", "",
             f"torch {env['torch']}, transformers {env.get('transformers')}, bitsandbytes "
             f"{env.get('bitsandbytes')}, peft {env.get('peft')}; commit {res['commit']}", ""]
    if res["decode"]:
        lines += ["| model | variant | ms / decode step | vs trl_dynamic | first call s | "
                  "peak extra GiB | status |", "|---|---|---|---|---|---|---|"]
        ref = {r["model"]: r.get("ms_per_step") for r in res["decode"]
               if r["variant"] == "trl_dynamic"}
        for r in res["decode"]:
            ms = r.get("ms_per_step")
            rel = f"{ms / ref[r['model']]:.2f}x" if ms and ref.get(r["model"]) else ""
            lines.append(
                f"| {r['model']} | {r['variant']} | {ms:.2f} | {rel} | {r['first_call_s']:.1f} | "
                f"{r['peak_extra_bytes'] / 2**30:.2f} | ok |" if r["status"] == "ok" else
                f"| {r['model']} | {r['variant']} | | | | | {r['status']} |")
        lines.append("")
    for c in res["checks"]:
        gr = c.get("greedy")
        if gr is None:
            continue
        lines += [f"## checks, {c['model']} (final norm x{c['peak_scale']}, median p of the "
                  f"greedy token {gr['median_max_p']:.2f})", "",
                  f"- greedy: {gr['identical_rows']}/{gr['rows']} rows token-identical over "
                  f"{gr['new']} tokens (prompts {min(gr['prompt_lengths'])}-"
                  f"{max(gr['prompt_lengths'])} tokens); first differences at "
                  f"{gr['first_difference_at']}",
                  f"- |Δ log p| of the chosen tokens, ours vs eager: max "
                  f"{gr['max_abs_dlogp_ours_vs_eager']:.2e}, mean "
                  f"{gr['mean_abs_dlogp_ours_vs_eager']:.2e}; eager batch vs eager alone: max "
                  f"{gr['max_abs_dlogp_eager_batch_vs_single']:.2e}, mean "
                  f"{gr['mean_abs_dlogp_eager_batch_vs_single']:.2e}"]
        for s in c.get("sampling", []):
            lines.append(f"- sampling ({s['settings']}, {s['sequences']} sequences each): mean "
                         f"log p / token eager {s['mean_logp_eager']:.4f}, ours "
                         f"{s['mean_logp_ours']:.4f}, z = {s['z']:+.2f}")
        w = c.get("weights")
        if w is not None:
            lines.append(f"- weights: the SGD step changed {w['rows_changed_by_step_eager']}/"
                         f"{w['rows']} greedy rows; after it ours equals eager in "
                         f"{w['rows_ours_equal_eager_after_step']}/{w['rows']}")
        if c.get("note"):
            lines.append(f"- {c['note']}")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b", help="comma list of 1b,8b")
    p.add_argument("--parts", default="decode,checks")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new", type=int, default=256, help="sampled tokens per decode timing")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--check-new", type=int, default=64, help="tokens per check completion")
    p.add_argument("--sample-rounds", type=int, default=6, help="batches sampled per side")
    p.add_argument("--peak-scale", type=float, default=6.0)
    p.add_argument("--model-cache", default="/tmp/grpo_lce_e2e_models")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--tag", default="")
    p.add_argument("--tiny", action="store_true", help="smoke run on the tiny offline Llama")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the --tiny smoke run")
    a = p.parse_args(argv)
    global DEVICE
    DEVICE = a.device
    if a.tiny:
        a.models, a.new, a.check_new, a.sample_rounds, a.peak_scale = "tiny", 16, 8, 3, 1.0
        a.tag = a.tag or "_tiny"
    a.variants = a.variants.split(",")
    parts = a.parts.split(",")
    device = torch.device(DEVICE)
    env = bc.env_info(device)
    for pkg in ("transformers", "peft", "bitsandbytes", "accelerate", "trl"):
        env[pkg] = bc.package_version(pkg)
    res = {"env": env, "commit": bc.git_commit(), "args": vars(a), "decode": [], "checks": []}
    stem = Path(a.out_dir) / f"generation_{bc.gpu_short_name(device)}{a.tag}"
    for name in a.models.split(","):
        if "decode" in parts:
            res["decode"] += decode_part(name, a)
            bc.write_json(stem.with_suffix(".json"), res)
        if "checks" in parts:
            res["checks"].append({})

            def save(out):
                res["checks"][-1] = out
                bc.write_json(stem.with_suffix(".json"), res)
            save(checks_part(name, a, save))
    md = markdown(res)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
