"""Decode speed of `trainers.sampling.DecodeLoop` against today's `FastSampler` and eager
`generate`, on the Llama-3.2-1B shape or (--model 8b) the Llama-3.1-8B shape (random init, LoRA
r=16 on all linear layers over a bf16 or an NF4 base).

Per (base, batch): random prompts of 4-40 tokens, left-padded; --new sampled tokens with TRL's
default sampling options (temperature 1, top_p 1, top_k 0) and an EOS id no row ever draws, so
every row runs to --new. Variants (--variants):

    hf_eager      model.generate, dynamic cache (TRL 1.16's own path), on --eager-new tokens:
                  eager is CPU-bound, about 50 ms per token whatever the length, so ms/token on
                  a shorter run is its per-token cost; its first call pays a cost for every new
                  cache length it meets, hence a short run keeps the benchmark short
    fast_sampler  trainers.generation.FastSampler (inductor, CUDA graphs "reduce-overhead")
    loop          trainers.sampling.DecodeLoop (hand-captured CUDA graphs, --check-every steps
                  each, one host check per replay)
    loop_sdpa_attention `loop` with the decode step's attention by SDPA over the whole masked
                  cache instead of `decode_attention` (the kernel plan's attention off; optional)
    loop_no_silu_mul  `loop` with the MLP's silu(gate) · up as torch ops after the gate/up
                  launch (the kernel plan's silu_mul off: an A/B of that fusion; optional)
    loop_torch_sample `loop` with the sampling step's reductions by torch's ops (the kernel
                  plan's sample off: an A/B of `race_sample`; optional)
    loop_cublas_head `loop` with the decode step's LM head by the module (cuBLAS) instead of
                  `head_logits` (the kernel plan's head off; optional)
    loop_2_per_sm `loop` with the decode linear's tile rule at 2 programs per SM
                  (`linear4bit.PROGRAMS_PER_SM`; an A/B of the rule; optional)
    loop_no_pdl   `loop` with every decode kernel launched without programmatic dependent
                  launch (GRPO_LCE_PDL=0 while it captures; an A/B of `kernels.pdl`; optional)
    loop_pdl_no_early `loop` with PDL but no kernel letting the next start before its programs
                  exit (`pdl.EARLY_NEXT_WAVES` 0; an A/B of the decode linear's early start)
    loop_sums_in_linear `loop` with every split projection summing its own partials (the kernel
                  plan's rope_sums and norm_sums off: an A/B of `kernels.split_sum`; optional)
    loop_no_norm_sums `loop` with o_proj and down_proj summing their own partials (norm_sums
                  off, where the plan has it on; optional)
    loop_no_lora_t `loop` with every q/k/v and gate/up launch forming LoRA's t in its K loop
                  (the kernel plan's lora_t off: an A/B of t from add_rmsnorm; optional)
    loop_lora_t_qkv `loop` with the q/k/v launches taking t from add_rmsnorm too
                  (`kernel_plan.LORA_T_GROUPS`; optional)
    loop_no_rope_attention `loop` with RoPE + cache write and attention in two launches (the
                  kernel plan's rope_attention off; optional)
    loop_one_step_splits `loop` with the decode linear's split rule letting a program run one K
                  step (`linear4bit.MIN_STEPS` 1; the 1B q/k/v and o launches split 8, not 4)
    loop_rope_warps1, loop_rope_warps2 `loop` with `rope_cache_write` on 1 or 2 warps a program
                  (`rope.NUM_WARPS` 4; an A/B of it)
    loop_norm_warps16 `loop` with `add_rmsnorm` at 4 elements a thread, up to 16 warps
                  (`rmsnorm.norm_warps`; an A/B of its rule)
    loop_attention_warps2, loop_attention_warps8 `loop` with `decode_attention` on 2 or 8 warps
                  a program (`decode_attention.NUM_WARPS`)
    loop_torch_record `loop` with the step's record and row state by torch's ops (the kernel
                  plan's record off: an A/B of `record_step`; optional)
    loop_register_tile `loop` with every decode linear on the register tile (`linear4bit_ws`
                  off: an A/B of the warp-specialized kernel)
    loop_ws_no_group `loop` with q/k/v on the register tile (the warp-specialized kernel
                  without its grouped launch)
    loop_ws_no_pdl `loop` with the warp-specialized kernel launched without PDL
    loop_ws_2_per_sm `loop` with the warp-specialized kernel's split rule aiming at 1.8 CTAs a
                  SM (`linear4bit_ws.CTAS_PER_SM`)
    loop_ws_early_next, loop_ws_early_next_one_a_sm, loop_ws_no_early `loop` with every launch
                  of the warp-specialized kernel letting the next kernel launch after its K
                  loops, only those of at most one CTA a SM, or none
                  (`linear4bit_ws.EARLY_NEXT_CTAS_PER_SM` 2, 1, 0)
    loop_ws_byte_planes, loop_ws_pair_table `loop` with every launch of the warp-specialized
                  kernel looking up in round(code · scale) tables of registers, or in the
                  code's pair table (`linear4bit_ws.PAIR_TABLE` 0 or 2)
    loop_ws_glu_2_stages, loop_ws_glu_4_stages `loop` with the gate/up + silu · mul launch
                  through the pair table on 2 or 4 stages (`linear4bit_ws.GLU_PAIR_STAGES`)
    loop_small_next_at_exit `loop` with add_rmsnorm and the decode attention letting the next
                  kernel launch at their exit, not their start (`pdl.SMALL_NEXT_AT_START`)
    loop_ws_3_stages `loop` with every other launch of the warp-specialized kernel on 3
                  stages too (`linear4bit_ws.STAGES`)
    loop_ws_reg_3_stages, loop_ws_reg_4_stages `loop` with the launches through the register
                  tables (8B q/k/v and o, every 1B launch) on 3 or 4 stages: more of their
                  few steps a CTA copied before they wait for the kernel before them

Each loop variant runs once per --kernels value: "torch" (the modules' own forwards) and "auto"
(the fused 4-bit + LoRA decode linear for the projections, add_rmsnorm for each residual add +
RMSNorm, rope_cache_write for each layer's RoPE + KV-cache write, race_sample for the sampling
step's reductions, record_step for its bookkeeping, head_logits for the LM head,
decode_attention for the attention); the row's
`kernels` column says which, `kernel_path` the loop's one-line plan.

Reported: the first call's wall time (compile / capture / first-call check included; Triton
compiles once per process, in the greedy check that runs first, and caches on disk), the loop's time from its first call to its first sampled token and its capture
seconds; then the median of --reps steady calls: wall ms per token (call time / new tokens,
prefill included; `new` says how many tokens the variant was timed on); for the loop also ms per
token inside the graph replays (CUDA events around each replay, in a separate call, since
reading the events syncs) and the rest ("outside": prefill, host checks, Python); peak memory
above the loaded model. Before timing, greedy completions (--check-new tokens) of each loop
kernels option against eager `generate`: rows token-identical, and at each first divergence the
eager logit gap between the two tokens in bf16 ulps of the row's max |logit| (a random-init
model's near-flat rows diverge at rounding-level ties; a broken forward gives gaps of many ulps).

    python -m bench.decode_loop --bases nf4                # batch 8 and 64, the default variants
    python -m bench.decode_loop --bases nf4 --variants fast_sampler,loop --kernels auto,torch
    python -m bench.decode_loop --model 8b --bases nf4 --batches 8 --variants loop
    python -m bench.decode_loop --tiny --device cpu        # smoke run, tiny fp32 model

Writes bench/results/decode_loop_<GPU>[_8b][tag].json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from bench import common as bc
from bench import e2e_common as E

VARIANTS = ("hf_eager", "fast_sampler", "loop", "loop_sdpa_attention", "loop_no_silu_mul",
            "loop_torch_sample", "loop_cublas_head", "loop_2_per_sm", "loop_no_pdl",
            "loop_pdl_no_early", "loop_sums_in_linear", "loop_no_norm_sums", "loop_torch_record",
            "loop_one_step_splits", "loop_rope_warps1", "loop_rope_warps2", "loop_norm_warps16",
            "loop_attention_warps2", "loop_attention_warps8", "loop_register_tile",
            "loop_ws_no_group", "loop_ws_no_pdl", "loop_ws_2_per_sm", "loop_ws_early_next",
            "loop_ws_early_next_one_a_sm",
            "loop_ws_no_early", "loop_ws_byte_planes", "loop_ws_pair_table", "loop_no_lora_t",
            "loop_lora_t_qkv", "loop_no_rope_attention", "loop_ws_glu_2_stages",
            "loop_ws_glu_4_stages", "loop_ws_3_stages", "loop_small_next_at_exit",
            "loop_ws_reg_3_stages", "loop_ws_reg_4_stages")
# the lab variants' kernel plans: `loop`'s without one piece
PLAN_WITHOUT = {"loop_no_silu_mul": {"silu_mul": frozenset()},
                "loop_torch_sample": {"sample": False},
                "loop_cublas_head": {"head": False},
                "loop_sdpa_attention": {"attention": False},
                "loop_sums_in_linear": {"rope_sums": False, "norm_sums": False},
                "loop_no_norm_sums": {"norm_sums": False},
                "loop_torch_record": {"record": False},
                "loop_no_lora_t": {"lora_t": frozenset()},
                "loop_no_rope_attention": {"rope_attention": False}}
DEFAULT_VARIANTS = ("hf_eager", "fast_sampler", "loop")


def load_policy(name: str, base: str, cache_dir: str, device: str):
    """`base` "bf16" or "nf4" (double quant, bf16 compute) + LoRA r=16 all-linear, adapters in
    bf16 with random B (so the adapter matters); the fp32 tiny model + LoRA on CPU."""
    from peft import get_peft_model

    cuda = device == "cuda"
    model = E.load_model(E.model_dir(name, cache_dir), device=device,
                         quantize=cuda and base == "nf4")
    model = get_peft_model(model, E.lora_config())
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and cuda:
                p.data = p.data.to(torch.bfloat16)
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 0.02)
    return model.eval()


def prompts(batch: int, V: int, device: str, seed: int = 0):
    """Left-padded (ids, mask) of `batch` random prompts of 4-40 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 41, (batch,), generator=g)
    P = int(lengths.max())
    ids = torch.randint(3, V, (batch, P), generator=g)
    mask = (torch.arange(P)[None] >= (P - lengths)[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def generation_config(new: int, V: int, **kw):
    """TRL 1.16's default sampling options; EOS = V, an id no row can draw."""
    from transformers import GenerationConfig

    opts = {"max_new_tokens": new, "do_sample": True, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": [V], "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
            "repetition_penalty": 1.0, **kw}
    return GenerationConfig(**opts, disable_compile=True)


class Variant:
    def __init__(self, name: str, model, device: str, check_every: int, kernels: str = "auto"):
        self.name, self.model = name, model
        self.sampler = None
        if name == "fast_sampler":
            from trainers.generation import FastSampler

            self.sampler = FastSampler()
        elif name.startswith("loop"):
            from trainers.sampling import DecodeLoop

            self.sampler = DecodeLoop(devices=(device,), check_every=check_every,
                                      kernels=kernels)

    @torch.no_grad()
    def __call__(self, ids, mask, config):
        if self.sampler is None:
            return self.model.generate(input_ids=ids, attention_mask=mask,
                                       generation_config=copy.deepcopy(config))
        with _lab_patch(self.name):
            out = self.sampler.generate(self.model, ids, mask, config)
        if out is None:
            raise RuntimeError(f"{self.name} off: {self.sampler.disabled_reason}")
        return out


def _lab_patch(name: str):
    """What a lab variant runs under (its graphs are captured inside, so they keep it): `loop`'s
    kernel plans with PLAN_WITHOUT's fields replaced, the decode linear's tile rule at 2
    programs per SM or with one-step splits, other warps for RoPE, the norm or attention, PDL
    off, PDL without the linear's early start, or the warp-specialized linear off; a null
    context for every other variant."""
    from trainers.sampling import loop
    from trainers.sampling.kernels import linear4bit, pdl

    if name == "loop_2_per_sm":
        return mock.patch.object(linear4bit, "PROGRAMS_PER_SM", 2)
    if name == "loop_one_step_splits":
        return mock.patch.object(linear4bit, "MIN_STEPS", 1)
    if name.startswith("loop_rope_warps"):  # loop_rope_warps1, loop_rope_warps2
        from trainers.sampling.kernels import rope

        return mock.patch.object(rope, "NUM_WARPS", int(name[-1]))
    if name == "loop_norm_warps16":
        from trainers.sampling.kernels import rmsnorm

        return mock.patch.object(rmsnorm, "norm_warps", lambda h: min(16, max(1, h // 128)))
    if name.startswith("loop_attention_warps"):  # loop_attention_warps2, loop_attention_warps8
        from trainers.sampling import decode_attention

        return mock.patch.object(decode_attention, "NUM_WARPS", int(name[-1]))
    if name == "loop_no_pdl":
        return mock.patch.dict(os.environ, {pdl.ENV: "0"})
    if name == "loop_register_tile":
        from trainers.sampling.kernels import linear4bit_ws

        return mock.patch.dict(os.environ, {linear4bit_ws.ENV: "0"})
    if name in ("loop_ws_reg_3_stages", "loop_ws_reg_4_stages"):
        from trainers.sampling.kernels import linear4bit_ws

        real, depth = linear4bit_ws.stages, int(name[-8])

        def deeper(glu, pair_table):
            return real(glu, pair_table) if pair_table else depth
        return mock.patch.object(linear4bit_ws, "stages", deeper)
    if name == "loop_small_next_at_exit":
        return mock.patch.object(pdl, "SMALL_NEXT_AT_START", False)
    if name == "loop_ws_3_stages":
        from trainers.sampling.kernels import linear4bit_ws

        return mock.patch.object(linear4bit_ws, "STAGES", 3)
    if name in ("loop_ws_glu_2_stages", "loop_ws_glu_4_stages"):
        from trainers.sampling.kernels import linear4bit_ws

        return mock.patch.object(linear4bit_ws, "GLU_PAIR_STAGES", int(name[-8]))
    if name == "loop_ws_no_group":  # q/k/v on the register tile (the ws kernel one projection)
        from trainers.sampling.kernels import linear4bit_ws

        real_reason = linear4bit_ws.reason

        def one(x, parts, glu, config):
            return "lab: no grouped launch" if len(parts) > 1 and not glu else real_reason(
                x, parts, glu, config)
        return mock.patch.object(linear4bit_ws, "reason", one)
    if name in ("loop_ws_byte_planes", "loop_ws_pair_table"):  # one lookup for every launch
        from trainers.sampling.kernels import linear4bit_ws

        return mock.patch.object(linear4bit_ws, "PAIR_TABLE", 0 if "byte" in name else 2)
    if name == "loop_ws_no_pdl":  # the ws kernel launched without PDL
        real_args = pdl.launch_args

        def args(kernel, device):
            return ({"PDL": False} if kernel.__name__ == "linear4bit_ws_kernel"
                    else real_args(kernel, device))
        return mock.patch.object(pdl, "launch_args", args)
    if name == "loop_ws_2_per_sm":  # the ws split rule aiming at two CTAs a SM
        from trainers.sampling.kernels import linear4bit_ws

        return mock.patch.object(linear4bit_ws, "CTAS_PER_SM", 1.8)
    if name in ("loop_ws_early_next", "loop_ws_early_next_one_a_sm", "loop_ws_no_early"):
        from trainers.sampling.kernels import linear4bit_ws

        return mock.patch.object(linear4bit_ws, "EARLY_NEXT_CTAS_PER_SM",
                                 {"loop_ws_early_next": 2.0, "loop_ws_early_next_one_a_sm": 1.0,
                                  "loop_ws_no_early": 0.0}[name])
    if name == "loop_pdl_no_early":
        return mock.patch.object(pdl, "EARLY_NEXT_WAVES", 0)
    if name == "loop_lora_t_qkv":  # t from the norm for q/k/v too
        from trainers.sampling import kernel_plan

        return mock.patch.object(kernel_plan, "LORA_T_GROUPS", ("q_proj", "gate_proj"))
    fields = PLAN_WITHOUT.get(name)
    if fields is None:
        return contextlib.nullcontext()
    real = loop.make_plan

    def plan(*a, **kw):
        made = real(*a, **kw)
        return dataclasses.replace(made, **fields, line=f"{made.line} (lab variant {name}: "
                                                        f"{', '.join(fields)} off)")
    return mock.patch.object(loop, "make_plan", plan)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def eager_greedy(model, ids, mask, new: int, V: int) -> list[list[int]]:
    from trainers.generation import trim_after_eos

    cfg = generation_config(new, V, do_sample=False)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    return trim_after_eos(ref[:, ids.shape[1]:], [V])


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.frexp(max(abs(x), 2.0**-126))[1] - 8)


@torch.no_grad()
def divergence_gap_ulps(model, ids, mask, ours, ref, max_rows: int = 16) -> list[float]:
    """For the first `max_rows` diverging rows: eager's batch-1 logit gap z[ref] - z[ours] at the
    first divergence (same prefix), in bf16 ulps of the row's max |z|."""
    out = []
    for b, (o, t) in enumerate(zip(ours, ref)):
        k = next((i for i, (x, y) in enumerate(zip(o, t)) if x != y), None)
        if k is None or len(out) >= max_rows:
            continue
        prefix = torch.tensor(t[:k], device=ids.device, dtype=ids.dtype)
        row = torch.cat([ids[b][mask[b].bool()], prefix])[None]
        z = model(input_ids=row, logits_to_keep=1).logits[0, -1].float()
        out.append(round((z[t[k]] - z[o[k]]).item() / bf16_ulp(z.abs().max().item()), 2))
    return out


def greedy_check(model, ids, mask, new: int, V: int, kernels: str, ref) -> dict:
    from trainers.sampling import DecodeLoop

    cfg = generation_config(new, V, do_sample=False)
    loop = DecodeLoop(devices=(ids.device.type,), kernels=kernels)
    ours = loop.generate(model, ids, mask, cfg)
    if ours is None:
        return {"kernels": kernels, "error": loop.disabled_reason or "not used"}
    same = sum(a == b for a, b in zip(ours.token_ids, ref))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(ours.token_ids, ref)]
    gaps = divergence_gap_ulps(model, ids, mask, ours.token_ids, ref)
    return {"kernels": loop.kernels, "rows": len(ref), "identical_rows": same,
            "first_divergence": first, "gap_ulps": gaps,
            "max_gap_ulps": max(map(abs, gaps), default=0.0),
            "kernel_path": "; ".join(p.line for p in loop._plans.values())}


def measure(variant: Variant, ids, mask, cfg, new: int, reps: int, device: str) -> dict:
    row = {"variant": variant.name}
    base_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row["first_call_s"] = timed(lambda: variant(ids, mask, cfg), device)
    walls = [timed(lambda: variant(ids, mask, cfg), device) for _ in range(reps)]
    row["ms_per_token"] = statistics.median(walls) / new * 1e3
    row["ms_per_token_spread"] = [min(walls) / new * 1e3, max(walls) / new * 1e3]
    if device == "cuda":
        row["peak_above_model_gib"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
    row["new"] = new
    loop = variant.sampler if variant.name.startswith("loop") else None
    if loop is not None:
        st = loop.stats
        row.update(first_token_s=st.first_token_s, capture_s=st.capture_s,
                   captures=st.captures, host_checks_per_call=st.host_checks / st.calls,
                   kernels=loop.kernels,  # "torch" if "auto" failed its first-call check
                   kernel_path="; ".join(p.line for p in loop._plans.values()))
        if device == "cuda":
            loop.time_graphs, before = True, st.graph_s
            variant(ids, mask, cfg)
            loop.time_graphs = False
            row["ms_in_graphs_per_token"] = (st.graph_s - before) / new * 1e3
            row["ms_outside_per_token"] = row["ms_per_token"] - row["ms_in_graphs_per_token"]
    elif variant.sampler is not None:
        row["compile_s"] = variant.sampler.stats.compile_s
    return row


def table(rows) -> str:
    cols = ("model", "base", "batch", "variant", "kernels", "new", "ms_per_token",
            "ms_in_graphs_per_token", "ms_outside_per_token", "first_call_s", "first_token_s",
            "capture_s", "peak_above_model_gib")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", choices=("1b", "8b"),
                   help="1b: Llama-3.2-1B shape; 8b: Llama-3.1-8B shape (random init, both)")
    p.add_argument("--bases", default="bf16,nf4", help="comma list of bf16,nf4")
    p.add_argument("--batches", default="8,64", help="comma list of batch sizes")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list of " +
                   ",".join(VARIANTS))
    p.add_argument("--kernels", default="torch,auto",
                   help="comma list of the loop variants' kernels options (torch, auto)")
    p.add_argument("--new", type=int, default=512, help="sampled tokens per call")
    p.add_argument("--eager-new", type=int, default=64,
                   help="sampled tokens per hf_eager call (its ms/token is per-token cost)")
    p.add_argument("--reps", type=int, default=2, help="timed steady calls per variant")
    p.add_argument("--eager-reps", type=int, default=1, help="timed calls of hf_eager")
    p.add_argument("--check-every", type=int, default=16, help="decode steps per graph")
    p.add_argument("--check-new", type=int, default=32, help="tokens of the greedy check")
    p.add_argument("--model-cache", default="/tmp/grpo_lce_e2e_models")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--tag", default="")
    p.add_argument("--tiny", action="store_true", help="smoke run on the tiny offline Llama")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the --tiny smoke run")
    a = p.parse_args(argv)
    name = a.model
    if a.tiny:
        name, a.bases, a.new, a.check_new, a.reps = "tiny", "bf16", 16, 8, 1
        a.eager_new = min(a.eager_new, a.new)
        a.tag = a.tag or "_tiny"
    device = torch.device(a.device)
    env = bc.env_info(device)
    for pkg in ("transformers", "peft", "bitsandbytes", "accelerate", "trl"):
        env[pkg] = bc.package_version(pkg)
    res = {"env": env, "commit": bc.git_commit(), "args": vars(a), "rows": [], "checks": []}
    tag = a.tag if a.model == "1b" or a.tiny else f"_{a.model}{a.tag}"
    path = Path(a.out_dir) / f"decode_loop_{bc.gpu_short_name(device)}{tag}.json"
    variants = a.variants.split(",")
    kernel_opts = a.kernels.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {','.join(VARIANTS)}")
    for k in kernel_opts:
        if k not in ("torch", "auto"):
            p.error(f"--kernels: {k!r} is not one of torch, auto")
    for base in a.bases.split(","):
        model = load_policy(name, base, a.model_cache, a.device)
        V = model.get_base_model().config.vocab_size
        for batch in map(int, a.batches.split(",")):
            ids, mask = prompts(batch, V, a.device)
            ref = eager_greedy(model, ids, mask, a.check_new, V)
            for kernels in kernel_opts:
                check = greedy_check(model, ids, mask, a.check_new, V, kernels, ref)
                res["checks"].append({"base": base, "batch": batch, **check})
                print(f"{base} batch {batch}: greedy vs eager generate: {check}", flush=True)
                bc.free_memory()
            runs = [(v, k) for v in variants for k in (kernel_opts if v.startswith("loop")
                                                       else (None,))]
            for vname, kernels in runs:
                eager = vname == "hf_eager"
                new = a.eager_new if eager else a.new
                try:
                    variant = Variant(vname, model, a.device, a.check_every, kernels or "auto")
                    row = measure(variant, ids, mask, generation_config(new, V), new,
                                  a.eager_reps if eager else a.reps, a.device)
                except Exception as exc:  # noqa: BLE001 - one failed variant, the rest runs
                    row = {"variant": vname, "kernels": kernels, "error": bc.short_error(exc)}
                row.update(model=name, base=base, batch=batch, kernels_requested=kernels)
                res["rows"].append(row)
                print(row, flush=True)
                bc.write_json(path, res)
                variant = None
                bc.free_memory()
        del model
        bc.free_memory()
    print(table(res["rows"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
