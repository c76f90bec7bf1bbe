"""Scenario grpo_fastgen of tests/_ddp_worker.py: GRPO with fast generation under DDP.

Each rank builds trainers.GRPOTrainer (tiny LoRA Llama, soft head, sampler="loop"; on CPU a CPU
`DecodeLoop` installed as the sampling tests do, on CUDA the trainer's own, which captures its
CUDA graphs), takes its share of TRL's first generation batch from the trainer's own dataloader
(TRL's RepeatSampler + accelerate's sharding: G = 2 copies of one prompt per rank, distinct
prompts on the two ranks), and calls TRL's `_generate_and_score_completions`, the path
`training_step` takes: sampling through our decode loop, rewards gathered over processes, the
advantages of the global batch sliced back to the rank. The training inputs it returns are
recorded (on the CPU), then one loss + backward under DDP on them, rank-local (`no_sync`) and
all-reduced, per loss type, as the `ddp` scenario does.

Sampling cannot be replayed in one process, so the single-process reference scores the
recorded samples: `global_batch` concatenates the ranks' inputs in rank order, which is the
order TRL's sampler dealt the global batch in (rank r holds rows [r·B/P, (r+1)·B/P)), and
`reference_results` takes the loss and gradients of that global batch in one process, with
the fp64 truth, exactly as the `ddp` scenario's reference treats its fixed batch. The loss
arguments of tests/test_ddp.py's docstring hold as they are: `num_items_in_batch` is TRL's
gathered global count (equal on both ranks, checked) and every rank holds B/P rows.

Concatenation. The prompts all have the same token length, so no rank left-pads its prompts
(`global_batch` refuses prompts of different widths: extra left padding would shift every
position, exact only up to RoPE's rounding). Completions are right-padded by TRL to the rank's
longest; padding them further on the right to the global longest (mask 0, per-token values 0)
changes nothing a real token sees (causal attention) nor any masked sum or mean the loss and
its metrics take.
"""

from __future__ import annotations

import time

import torch

G = 2  # generations per prompt: one prompt per rank with B = 4 rows on 2 ranks
# equal token lengths (trainers.tiny's tokenizer is per character): no prompt padding
PROMPTS = ("1+1=", "2*3=", "9-4=", "7+2=")
CASE = "grpo_fastgen"


def reward(completions, **kwargs):
    """A reward that differs between almost any two sampled completions (a position-weighted
    character sum), so each group of G has nonzero advantages and every rank's gradient is
    nonzero; the completions' lengths alone would tie (the tiny model rarely samples EOS)."""
    return [sum((i + 1) * ord(ch) for i, ch in enumerate(c)) / 100.0 for c in completions]


def build(tok, out_dir, world: int, *, device: str = "cpu"):
    """trainers.GRPOTrainer on the tiny LoRA Llama with its head scaled down (entropies of a
    few nats: the raw tiny model samples one token over and over, and every group would tie),
    G generations per prompt, sampler "loop"."""
    import _ddp_worker as W
    import trl
    from _tiny_models import soft_head_model
    from datasets import Dataset

    from trainers import GRPOTrainer

    args = trl.GRPOConfig(
        output_dir=out_dir, report_to="none", use_cpu=device == "cpu", bf16=False,
        per_device_train_batch_size=W.B // world, num_generations=G, max_completion_length=W.C,
        save_strategy="no", seed=0,
    )
    tr = GRPOTrainer(model=soft_head_model(tok, tied=True, peft=True), reward_funcs=reward,
                     args=args, train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}),
                     processing_class=tok, sampler="loop")
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
    return tr


def _record_samples(samplers) -> list:
    """Wraps `samplers.serve` so that each served Sample's token lists are kept."""
    seen, serve = [], samplers.serve

    def recording(*args, **kwargs):
        sample = serve(*args, **kwargs)
        seen.append(None if sample is None else (sample.sampler, sample.token_ids))
        return sample

    samplers.serve = recording
    return seen


def _cpu(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def rank_results(rank, world, tok, out_dir, device) -> dict:
    import _ddp_worker as W
    import torch.distributed as dist

    tr = build(tok, out_dir, world, device=device)
    ddp = tr.accelerator.prepare_model(tr.model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    tr.model_wrapped = ddp  # as `Trainer.train` sets it: generation unwraps it
    if device == "cpu":  # the trainer's own loop runs on CUDA only
        from trainers.sampling.loop import DecodeLoop

        tr._lce_samplers.loop = DecodeLoop(devices=("cpu",), check_every=4)
    samplers = tr._lce_samplers
    seen = _record_samples(samplers)
    batch = next(iter(tr.get_train_dataloader()))  # this rank's share, as TRL deals it
    # start together, so that a rank's generation time is its own work plus any wait on the
    # other rank inside generation (TRL's gathers), not the skew of building the trainers
    dist.barrier()
    t0 = time.perf_counter()
    inputs = tr._generate_and_score_completions(batch)
    score_s = time.perf_counter() - t0
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items()
               if k.startswith(("fast_generation/", "timing/"))}
    loop = samplers.loop
    res = {CASE: {
        "prompts": [x["prompt"] for x in batch],
        "inputs": {k: _cpu(v) for k, v in inputs.items()},
        "served": dict(samplers.served), "seen": seen,
        "loop_off": samplers.loop_off, "loop_disabled": loop.disabled_reason,
        "metrics": metrics, "generation_s": metrics["timing/generation_s"],
        "score_s": score_s, "capture_s": loop.stats.capture_s, "captures": loop.stats.captures,
    }}
    dev = tr.accelerator.device
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    for loss_type in W.LOSS_TYPES:
        tr.loss_type = loss_type
        tr._metrics["train"].clear()
        with ddp.no_sync():  # rank-local gradient, no all-reduce
            _, local = W.grpo_step(tr, ddp, inputs)
        loss, synced = W.grpo_step(tr, ddp, inputs)
        res[f"{CASE}_{loss_type}"] = {
            "loss": loss, "local": W._clean_names(local), "synced": W._clean_names(synced),
            "entropy": tr._metrics["train"]["entropy"][-1],
        }
    return res


def _pad(t: torch.Tensor, width: int, value, *, left: bool) -> torch.Tensor:
    extra = width - t.size(1)
    if extra == 0:
        return t
    fill = torch.full((t.size(0), extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def global_batch(parts: list[dict], pad_token_id: int) -> dict:
    """The ranks' recorded inputs (rank order) as one global batch (module docstring)."""
    keys = parts[0].keys()
    if any(p.keys() != keys for p in parts):
        raise ValueError("parts: the ranks' inputs have different keys: "
                         f"{[list(p) for p in parts]}")
    widths = {p["prompt_ids"].size(1) for p in parts}
    if len(widths) != 1:
        raise ValueError(f"parts: prompt widths differ across ranks ({sorted(widths)}); "
                         "left padding would shift positions")
    width = max(p["completion_ids"].size(1) for p in parts)
    out = {}
    for k in keys:
        vals = [p[k] for p in parts]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            raise ValueError(f"parts: input {k!r} is not a tensor on every rank: "
                             f"{[type(v).__name__ for v in vals]}")
        if vals[0].dim() == 0:  # a global scalar (num_items_in_batch): the same on every rank
            if not all(torch.equal(v, vals[0]) for v in vals):
                raise ValueError(f"parts: global scalar {k!r} differs across ranks: {vals}")
            out[k] = vals[0]
            continue
        per_sequence = k == "importance_sampling_ratio" and all(v.size(1) == 1 for v in vals)
        if vals[0].dim() >= 2 and not k.startswith("prompt_") and not per_sequence:
            # per completion token (TRL's sequence-level importance ratio is (rows, 1))
            if any(v.size(1) != p["completion_ids"].size(1) for v, p in zip(vals, parts)):
                raise ValueError(f"parts: {k!r} is not per completion token: "
                                 f"{[tuple(v.shape) for v in vals]}")
            value = pad_token_id if k == "completion_ids" else 0
            vals = [_pad(v, width, value, left=False) for v in vals]
        out[k] = torch.cat(vals, dim=0)
    return out


def reference_results(tok, ranks: list[dict], out_dir, device: str = "cpu") -> dict:
    """The single process on the global batch the ranks sampled: per loss type its loss,
    gradients and entropy metric, and the same step with TRL's head in fp64 (the truth)."""
    import _ddp_worker as W
    from _trainer_pairs import trl_head_in_fp64

    tr = build(tok, out_dir, 1, device=device)
    dev = tr.accelerator.device
    batch = global_batch([rk[CASE]["inputs"] for rk in ranks], tok.pad_token_id)
    batch = {k: v.to(dev) for k, v in batch.items()}
    ref = {}
    for loss_type in W.LOSS_TYPES:
        tr.loss_type = loss_type
        tr._metrics["train"].clear()
        loss, grads = W.grpo_step(tr, tr.model, batch)
        ref[f"{CASE}_{loss_type}"] = {"loss": loss, "grads": grads,
                                      "entropy": tr._metrics["train"]["entropy"][-1]}
        with trl_head_in_fp64(tr):
            ref[f"{CASE}_{loss_type}"]["fp64"] = W.grpo_step(tr, tr.model, batch)
    return ref
