"""trainers.DPOTrainer, KTOTrainer, RLOOTrainer and DistillationTrainer for tests/test_ddp.py: the
builders, each trainer's global batch and the halves the two ranks get, and one step.

Shared by the single-process reference (in the test's process) and the ranks (scenarios "dpo",
"kto", "rloo" and "distillation" of tests/_ddp_worker.py), so that both sides start from
bit-identical weights. Every model is a tiny fp32 one with LoRA on every linear layer but the
(frozen) head; the batches are the single-process trainer tests' constructions with 4 rows
(pairs, examples) globally, 2 per rank:

    dpo           Llama, untied; `peft_config` on a plain model, so the reference is the
                  disabled adapter; loss_type "sigmoid", β 0.5. The first 4 pairs of
                  tests/test_trainers_dpo.py's data, collated per rank as its dataloader does
                  (each rank pads to its own longest pair; the reference to the global one).
    kto           Qwen2, untied; a PeftModel policy, so the reference is TRL's "ref" copy of the
                  initial adapter; loss_type "kto" with its KL pass, β 0.5, weights 1.2 / 0.8.
                  The first 4 examples of tests/test_trainers_kto.py's data (desirable,
                  undesirable | desirable, desirable), collated per rank. Their KL completions
                  are the reference trainer's (TRL rotates the completions within each
                  `per_device_train_batch_size` block when it prepares the dataset), so both
                  sides score the same KL pairs.
    rloo          Llama, untied, τ 0.7, ε 0.3 / ε_high 0.35. tests/test_trainers_rloo.py's rows
                  (left-padded prompts, right-padded completions), old log-probs the current
                  ones plus noise: one row of rank 1 leaves the clip range, the other three give
                  gradients. Rank r gets rows [2r, 2r + 2).
    distillation  student: Llama, tied, head scaled ¼ (`soft_head_model`); teacher: Qwen2 of
                  width 96, untied, no adapter; β 0.5 (generalized JSD). 4 rows laid out as TRL's
                  `_generate_and_score_completions` does (a tool mask on one row) with the global
                  `num_items_in_batch`; rank r gets rows [2r, 2r + 2).

Untied heads for DPO, KTO and RLOO: the raw tiny models with a tied head predict their input
token with near certainty (entropies ~1e-3 nats), which leaves little for a loss to compare.

`step` also reports how many grpo_lce calls the step made (`grpo_lce._dispatch.recording`) and
the trainer's fallback reasons (`FusedHeadMixin._lce_fallbacks_logged`), so the test can tell
that the fused path ran on the ranks and not TRL's own head.
"""

from __future__ import annotations

import torch

from _trainer_pairs import ragged_ids_and_mask, trl_head_in_fp64

NAMES = ("dpo", "kto", "rloo", "distillation")
ROWS = 4  # global pairs (DPO), examples (KTO) or rows (RLOO, distillation)
P, C = 6, 9  # RLOO prompt and completion lengths


def _dpo_data():
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?", "aaaa", "xyz"],
        "chosen": ["2", "66 66", "def ghi", "5, I think", "aaaa", "zzzz"],
        "rejected": ["3", "6", "xyz", "4, no", "ab", "zz zz zz"],
    })


def _kto_data():
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?", "aaaa", "xyz"],
        "completion": ["2", "66 66", "def ghi", "5, I think", "aaaa", "zz zz"],
        "label": [True, False, True, True, False, True],
    })


def _prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z"] * 2})


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def build(name: str, tok, out_dir: str, world: int, *, device: str = "cpu", model=None):
    """The trainer `name` (module docstring) for a run on `world` processes, in train mode.
    `model`: the policy as the trainer receives it, in place of the tiny one (DPO's without an
    adapter: its LoraConfig adds one)."""
    import trl
    from _tiny_models import lora_tiny_llama, lora_tiny_qwen2, soft_head_model
    from _trainer_pairs import randomize_adapter
    from peft import LoraConfig

    import trainers

    if name not in NAMES:
        raise ValueError(f"name={name!r}: expected one of {NAMES}")
    if model is None:  # the tiny policy of each scenario
        model = {"dpo": lambda: lora_tiny_llama(tok, tied=False, peft=False),
                 "kto": lambda: lora_tiny_qwen2(tok, tied=False),
                 "rloo": lambda: lora_tiny_llama(tok, tied=False),
                 "distillation": lambda: soft_head_model(tok, "llama", tied=True, peft=True),
                 }[name]()
    common = dict(output_dir=out_dir, report_to="none", use_cpu=device == "cpu", bf16=False,
                  per_device_train_batch_size=ROWS // world, save_strategy="no", seed=0)
    if name == "dpo":
        tr = trainers.DPOTrainer(
            model=model, args=trl.DPOConfig(**common, beta=0.5, loss_type="sigmoid"),
            train_dataset=_dpo_data(), processing_class=tok,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        assert tr.ref_model is None and "ref" not in tr.model.peft_config
    elif name == "kto":
        tr = trainers.KTOTrainer(
            model=model,
            args=trl.KTOConfig(**common, beta=0.5, desirable_weight=1.2, undesirable_weight=0.8),
            train_dataset=_kto_data(), processing_class=tok)
        assert tr.calculate_KL and "ref" in tr.model.peft_config
    elif name == "rloo":
        tr = trainers.RLOOTrainer(
            model=model, reward_funcs=_reward,
            args=trl.RLOOConfig(**common, num_generations=ROWS, max_completion_length=C,
                                temperature=0.7, epsilon=0.3, epsilon_high=0.35),
            train_dataset=_prompts(), processing_class=tok)
    elif name == "distillation":
        tr = trainers.DistillationTrainer(
            model=model,
            teacher_model=soft_head_model(tok, "qwen2", tied=False, peft=False, hidden=96, seed=7),
            args=trl.DistillationConfig(**common, beta=0.5, max_completion_length=8),
            train_dataset=_prompts(), processing_class=tok)
    if name in ("dpo", "kto"):
        # the policy's adapter moves away from its reference (the disabled or the "ref" one)
        randomize_adapter(tr.model, seed=3)
    tr.model.train()
    return tr


def _rows(batch: dict, rank: int, world: int) -> dict:
    """Rank r's rows of a global batch; scalars (num_items_in_batch) are kept."""
    n = ROWS // world
    return {k: v[rank * n:(rank + 1) * n] if v.dim() > 0 else v for k, v in batch.items()}


def _rloo_batch(tok, tr):
    """tests/test_trainers_rloo.py's `_inputs`: what `_generate_and_score_completions` hands to
    `compute_loss`, old log-probs the current ones plus noise."""
    ids, mask = ragged_ids_and_mask(tok, P, C)  # (ROWS, P + C), ROWS = 4
    dev = tr.accelerator.device
    with torch.no_grad():
        lp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids.to(dev), mask.to(dev), C)
    lp = lp.cpu()
    g = torch.Generator().manual_seed(7)
    return {
        "prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P],
        "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
        "old_logps": (lp * mask[:, P:]).sum(1) + 0.3 * torch.randn(ROWS, generator=g),
        "advantages": torch.randn(ROWS, generator=g),
    }


def _distillation_batch(tok):
    """tests/test_trainers_distillation.py's `_batch` with 4 rows, and the global
    `num_items_in_batch` (TRL gathers the loss-mask count over processes)."""
    g = torch.Generator().manual_seed(0)
    prompt, K = 6, 7
    batch = {
        "prompt_ids": torch.randint(8, len(tok), (ROWS, prompt), generator=g),
        "prompt_mask": torch.ones(ROWS, prompt, dtype=torch.long),
        "completion_ids": torch.randint(8, len(tok), (ROWS, K), generator=g),
        "completion_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5,
                                         [1] * 5 + [0] * 2]),
        "tool_mask": torch.ones(ROWS, K, dtype=torch.long),
    }
    batch["prompt_mask"][1, :2] = 0
    batch["prompt_mask"][2, :4] = 0
    batch["prompt_ids"][batch["prompt_mask"] == 0] = tok.pad_token_id
    batch["completion_ids"][batch["completion_mask"] == 0] = tok.pad_token_id
    batch["tool_mask"][0, 2:5] = 0  # tokens a tool wrote: in the input, out of the loss
    batch["num_items_in_batch"] = (batch["completion_mask"] * batch["tool_mask"]).sum()
    return batch


def batches(name: str, tok, tr, world: int) -> dict:
    """{"global": the global batch, "ranks": [rank r's half]}; `tr` is the reference trainer
    (its collator, its dataset, its model for RLOO's old log-probs)."""
    if name in ("dpo", "kto"):
        def collate(idx):
            return tr.data_collator([tr.train_dataset[i] for i in idx])

        n = ROWS // world
        return {"global": collate(range(ROWS)),
                "ranks": [collate(range(r * n, (r + 1) * n)) for r in range(world)]}
    full = _rloo_batch(tok, tr) if name == "rloo" else _distillation_batch(tok)
    return {"global": full, "ranks": [_rows(full, r, world) for r in range(world)]}


def _grads(model) -> dict[str, torch.Tensor]:
    """Gradients by parameter name, without DDP's `module.` prefix; FSDP2's sharded (DTensor)
    gradients gathered whole (`full_tensor`, a collective: every rank walks the same names)."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n.removeprefix("module.")] = g.detach().to("cpu", copy=True)
    return out


def step(tr, model, inputs: dict) -> dict:
    """One `compute_loss` + backward of `tr` through `model` (the trainer's model, its DDP
    wrapper, or the model itself after `fully_shard`): loss, gradients, the logged entropy, the number of grpo_lce calls and the
    trainer's fallback reasons."""
    from grpo_lce._dispatch import recording

    tr._metrics["train"].clear()
    model.zero_grad(set_to_none=True)
    with recording() as rec:
        loss = tr.compute_loss(model, dict(inputs))
        loss.backward()
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items()}
    return {"loss": loss.detach().cpu(), "grads": _grads(model), "entropy": metrics["entropy"],
            "metrics": metrics, "calls": len(rec.paths),
            "fallbacks": sorted(tr._lce_fallbacks_logged)}


def token_mean_loss(tr, model, inputs: dict) -> dict:
    """DistillationTrainer's loss without `num_items_in_batch` (evaluation's case: TRL divides
    by the micro-batch's own count of loss tokens), and that count."""
    inputs = {k: v for k, v in inputs.items() if k != "num_items_in_batch"}
    with torch.no_grad():
        loss = tr.compute_loss(model, inputs).cpu()
    return {"loss": loss,
            "n_valid": int((inputs["completion_mask"] * inputs["tool_mask"]).sum())}


def reference_results(name: str, tr, batch: dict) -> dict:
    """The single-process results of the reference trainer `tr` on the global batch (moved to
    the trainer's device)."""
    dev = tr.accelerator.device
    inputs = {k: v.to(dev) for k, v in batch["global"].items()}
    res = step(tr, tr.model, inputs)
    if name == "distillation":
        res["token_mean_loss"] = token_mean_loss(tr, tr.model, inputs)
    return res


def reference_with_fp64(name: str, tr, batch: dict) -> dict:
    """`reference_results`, with the same step in fp64 (`trl_head_in_fp64`) under "fp64":
    (loss, grads), the truth the tolerances measure both sides against (and distillation's
    token-mean loss in fp64 under its own "fp64")."""
    ref = reference_results(name, tr, batch)
    with trl_head_in_fp64(tr):
        r64 = reference_results(name, tr, batch)
    ref["fp64"] = r64["loss"], r64["grads"]
    if name == "distillation":
        ref["token_mean_loss"]["fp64"] = r64["token_mean_loss"]["loss"]
    return ref


def rank_results(name: str, rank: int, world: int, tok, batch: dict, out_dir: str,
                 device: str) -> dict:
    """On rank `rank` of a process group: the trainer under accelerate's DDP wrapper, one step
    on this rank's half inside `no_sync()` (the rank-local gradient) and one all-reduced."""
    tr = build(name, tok, out_dir, world, device=device)
    ddp = tr.accelerator.prepare_model(tr.model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    dev = tr.accelerator.device
    inputs = {k: v.to(dev) for k, v in batch["ranks"][rank].items()}
    with ddp.no_sync():
        local = step(tr, ddp, inputs)
    res = step(tr, ddp, inputs)
    res["local"], res["synced"] = local["grads"], res.pop("grads")
    if name == "distillation":
        res["token_mean_loss"] = token_mean_loss(tr, ddp, inputs)
    return res
