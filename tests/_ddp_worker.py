"""Multi-process half of tests/test_ddp.py (CPU, gloo) and tests/test_multigpu.py (GPUs, nccl).

    python tests/_ddp_worker.py --out DIR --port PORT [--nprocs 2] [--scenarios ddp,fsdp2]
                                [--device cpu|cuda]
    python tests/_ddp_worker.py --out DIR --reference [--device cpu|cuda]
    python tests/_ddp_worker.py --out DIR --fastgen-reference [--device cpu|cuda]

Reads DIR/inputs.pt (the global batches, written by the test), spawns P processes with
`torch.multiprocessing.spawn`, and each rank r writes DIR/rank{r}.pt: per scenario its loss,
gradients and metrics on its slice of the global batch. The builders here (`tiny_model`,
`grpo_trainer`, `sft_trainer`) are shared with the single-process reference in the test, so
both sides start from bit-identical weights.

`--device cuda`: rank r runs on cuda:r and accelerate picks the nccl backend (`--device cpu`,
the default: gloo). `--reference`: no process group; one process on the device (cuda: the
first visible GPU) writes DIR/inputs.pt and the single-process results DIR/ref.pt, the same
quantities the CPU test computes in-process (tests/test_multigpu.py runs it in its own process,
so that the GPU state and the accelerate singleton of the pytest process stay untouched).
All results are saved on the CPU. On CUDA, fp32 GEMMs are kept in full fp32 (TF32 off, cuDNN
deterministic): `_exact_fp32`.

Scenarios:
  ddp    trainers.GRPOTrainer (loss_type dapo and grpo, LoRA) and trainers.SFTTrainer (LoRA)
         under accelerate's DistributedDataParallel wrapper; per loss, the rank-local gradient
         (inside `no_sync()`) and the all-reduced one.
  fsdp2  trainers.GRPOTrainer (dapo) under `fully_shard` laid out as accelerate 1.15 does it
         (one group per decoder layer, a [norm, embed, lm_head] tail group that is not
         resharded after forward, then the root): full fine-tuning with a tied, trainable head
         (the head is a DTensor gathered by trainers.sharded), and LoRA.
  fsdp2_trainers
         trainers.SFTTrainer, DPOTrainer, KTOTrainer, RLOOTrainer and DistillationTrainer
         (LoRA: frozen head) with the policy under `fully_shard` laid out as in `fsdp2`, one
         step each on the rank's rows, gradients gathered whole (`_fsdp2_trainers`); results
         "fsdp2_sft", "fsdp2_dpo", ..., and "fsdp2_distillation_sharded_teacher" (the teacher
         sharded too). Compared with the single-process "sft", "dpo", ... results. Needs the
         trainers' batches, as the four DDP scenarios below; not in the default list.
  zero3  trainers.GRPOTrainer (dapo, LoRA: frozen head) on a DeepSpeed ZeRO-3 engine built by
         `deepspeed.initialize` (every parameter partitioned, the head weight of numel 0 between
         forwards and gathered by trainers.sharded; gradients reduce-scattered by ZeRO-3 and read
         back whole with `safe_get_full_grad`). Needs deepspeed; not in the default list.
  zero3_trainers
         trainers.SFTTrainer, DPOTrainer, KTOTrainer, RLOOTrainer and DistillationTrainer
         (LoRA: frozen head) with the policy on a ZeRO-3 engine built as in `zero3`, one step
         each on the rank's rows (`_zero3_trainers`); distillation's teacher on its own ZeRO-3
         engine from TRL's `prepare_deepspeed`, as TRL does under DeepSpeed. Results
         "zero3_sft", "zero3_dpo", ..., compared with the single-process "sft", "dpo", ...
         results. Needs deepspeed and the trainers' batches; not in the default list.
  dpo, kto, rloo, distillation
         trainers.DPOTrainer, KTOTrainer, RLOOTrainer and DistillationTrainer (LoRA) under
         accelerate's DDP wrapper, as the `ddp` scenario (tests/_ddp_trainers.py: builders,
         batches, step). Their batches are written by tests/test_ddp.py (CPU) or by
         `--reference` (tests/test_multigpu.py); not in the default list.
  grpo_fastgen
         trainers.GRPOTrainer (LoRA, sampler "loop") under DDP sampling its own generation
         batch through our decode loop inside TRL's `_generate_and_score_completions`, each
         rank its own prompts and its own loop (captures on CUDA); the recorded inputs, the
         timings, then loss and gradients per loss type as in `ddp` (tests/_ddp_fastgen.py).
         Its reference needs the ranks' samples: `--fastgen-reference`, run after the ranks.
         Not in the default list.
  ddp_nf4
         GRPO (dapo), SFT, DPO, KTO, RLOO and distillation on bitsandbytes NF4 bases with LoRA
         under accelerate's DDP wrapper, as `ddp` (tests/_ddp_nf4.py: the bases, quantized
         once and loaded from DIR/nf4 by both sides, and the fp64 twin). Needs the batches and
         checkpoints the test or `--reference` writes; not in the default list.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import warnings

import torch

import _ddp_trainers
from _trainer_pairs import fused_head_ran, ragged_ids_and_mask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, P, C = 4, 6, 9  # global completions, prompt length, completion length
LOSS_TYPES = ("dapo", "grpo")  # the two whose DDP average equals the global-batch loss exactly


def tiny_model(tok, *, peft: bool, tied: bool = True):
    """Tiny fp32 Llama (as the trainer tests), with random LoRA B matrices."""
    from _tiny_models import lora_tiny_llama

    return lora_tiny_llama(tok, peft=peft, tied=tied)


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def grpo_trainer(tok, model, out_dir, world: int, *, device: str = "cpu", **config):
    import trl
    from datasets import Dataset

    from trainers import GRPOTrainer

    args = trl.GRPOConfig(
        output_dir=out_dir, report_to="none", use_cpu=device == "cpu", bf16=False,
        per_device_train_batch_size=B // world, num_generations=B, max_completion_length=C,
        save_strategy="no", seed=0, **config,
    )
    data = Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z"] * 2})
    tr = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                     processing_class=tok)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
    return tr


def sft_trainer(tok, model, out_dir, world: int, *, device: str = "cpu"):
    import trl
    from datasets import Dataset

    from trainers import SFTTrainer

    args = trl.SFTConfig(
        output_dir=out_dir, report_to="none", use_cpu=device == "cpu", bf16=False,
        per_device_train_batch_size=B // world, save_strategy="no", seed=0,
    )
    tr = SFTTrainer(model=model, args=args, processing_class=tok,
                    train_dataset=Dataset.from_dict({"text": ["abc", "hello world"] * 4}))
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    return tr


def grpo_batch(tok, logp_model_trainer):
    """The global GRPO batch (B rows) as `_generate_and_score_completions` hands it over:
    ragged left-padded prompts and right-padded completions, old log-probs off-policy (current
    ones plus noise, so the clipped branch is exercised) and the global token count."""
    g = torch.Generator().manual_seed(123)
    ids, mask = ragged_ids_and_mask(tok, P, C, generator=g)  # (B, P + C), B = 4
    tr = logp_model_trainer
    dev = tr.accelerator.device
    with torch.no_grad():
        logps, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids.to(dev), mask.to(dev), C)
    logps = logps.cpu()
    return {
        "prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P],
        "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
        "advantages": torch.randn(B, generator=g),
        "old_per_token_logps": logps + 0.3 * torch.randn(B, C, generator=g),
        "num_items_in_batch": mask[:, P:].sum(),  # global: TRL gathers it over processes
    }


def sft_batch(tok):
    """A collated global SFT batch: right padding, prompt tokens masked to −100 (ragged)."""
    g = torch.Generator().manual_seed(5)
    L = 14
    ids = torch.randint(8, len(tok), (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    for row, n in enumerate((14, 9, 12, 5)):
        mask[row, n:] = 0
    ids[mask == 0] = tok.pad_token_id
    labels = ids.masked_fill(mask == 0, -100)
    for row, n in enumerate((3, 1, 6, 2)):  # prompt lengths
        labels[row, :n] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    """Rank r's rows of the global batch; global scalars (num_items_in_batch) are kept."""
    n = B // world
    return {k: v[rank * n:(rank + 1) * n] if v.dim() > 0 else v for k, v in batch.items()}


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            out[name] = g.detach().to("cpu", copy=True)
    return out


def grpo_step(tr, model, inputs) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of one `compute_loss` + backward, which must run grpo_lce's head
    (`fused_head_ran`: else both sides of a comparison could be TRL's)."""
    model.zero_grad(set_to_none=True)
    with fused_head_ran(tr):
        loss = tr.compute_loss(model, dict(inputs))
        loss.backward()
    return loss.detach().cpu(), grads_of(model)


def sft_step(tr, model, inputs, num_items) -> tuple[torch.Tensor, dict]:
    """As `grpo_step`, with `num_items_in_batch`."""
    model.zero_grad(set_to_none=True)
    with fused_head_ran(tr):
        loss = tr.compute_loss(model, dict(inputs), num_items_in_batch=num_items)
        loss.backward()
    return loss.detach().cpu(), grads_of(model)


def _clean_names(grads: dict) -> dict:
    """Parameter names without DDP's `module.` prefix, as in the single-process model."""
    return {n.removeprefix("module."): g for n, g in grads.items()}


def _ddp(rank, world, tok, batches, out_dir, device):
    res = {}
    tr = grpo_trainer(tok, tiny_model(tok, peft=True), out_dir, world, device=device)
    ddp = tr.accelerator.prepare_model(tr.model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    dev = tr.accelerator.device
    res["meta"] = {"device": str(next(ddp.parameters()).device), "backend": dist_backend()}
    inputs = to_device(rank_slice(batches["grpo"], rank, world), dev)
    for loss_type in LOSS_TYPES:
        tr.loss_type = loss_type
        tr._metrics["train"].clear()
        with ddp.no_sync():  # rank-local gradient, no all-reduce
            _, local = grpo_step(tr, ddp, inputs)
        loss, synced = grpo_step(tr, ddp, inputs)
        res[f"grpo_{loss_type}"] = {
            "loss": loss, "local": _clean_names(local), "synced": _clean_names(synced),
            "entropy": tr._metrics["train"]["entropy"][-1],
        }
    sft = sft_trainer(tok, tiny_model(tok, peft=True), out_dir, world, device=device)
    ddp = sft.accelerator.prepare_model(sft.model)
    inputs = to_device(rank_slice(batches["sft"], rank, world), dev)
    num_items = batches["sft_num_items"].to(dev)
    with ddp.no_sync():
        _, local = sft_step(sft, ddp, inputs, num_items)
    loss, synced = sft_step(sft, ddp, inputs, num_items)
    res["sft"] = {"loss": loss, "local": _clean_names(local), "synced": _clean_names(synced)}
    return res


def fully_shard_like_accelerate(model, mesh=None):
    """`fully_shard` the way accelerate 1.15's fsdp2_prepare_model lays a Llama out. `mesh`
    defaults to FSDP2's own (the *accelerator's* device type whatever the backend, so a gloo run
    on a machine with GPUs needs an explicit CPU mesh)."""
    from torch.distributed.fsdp import fully_shard

    from trainers.models import unwrap_causal_lm

    lm = unwrap_causal_lm(model)
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    tail = [lm.model.norm, embed, head] if embed.weight is head.weight else [lm.model.norm, head]
    if embed.weight is not head.weight:
        fully_shard(embed, mesh=mesh, reshard_after_forward=True)
    fully_shard(tail, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2(rank, world, tok, batches, out_dir, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainers.head import lm_head_params
    from trainers.models import unwrap_causal_lm

    res = {}
    for peft in (False, True):
        tr = grpo_trainer(tok, tiny_model(tok, peft=peft), out_dir, world, device=device,
                          loss_type="dapo")
        dev = tr.accelerator.device
        inputs = to_device(rank_slice(batches["grpo"], rank, world), dev)
        fully_shard_like_accelerate(tr.model, mesh=init_device_mesh(dev.type, (world,)))
        head_w = unwrap_causal_lm(tr.model).get_output_embeddings().weight
        assert isinstance(head_w, DTensor), type(head_w)
        w, _ = lm_head_params(tr.model)
        assert not isinstance(w, DTensor) and w.shape == head_w.shape
        loss, grads = grpo_step(tr, tr.model, inputs)
        res[f"fsdp2_{'lora' if peft else 'full'}"] = {"loss": loss, "synced": grads}
    return res


def _head_type(model) -> str:
    """The type name of the LM head weight of `model` (what `trainers.sharded` is handed)."""
    from trainers.models import unwrap_causal_lm

    return type(unwrap_causal_lm(model).get_output_embeddings().weight).__name__


def _fsdp2_trainers(rank, world, tok, batches, out_dir, device):
    """Scenario fsdp2_trainers: SFT, DPO, KTO, RLOO and distillation (LoRA: frozen head) with
    the policy `fully_shard`-ed as accelerate 1.15 lays it out, one step each on this rank's
    rows; gradients gathered whole. What is sharded is what accelerate + TRL 1.16 shard: the
    policy, and with it DPO's reference (the disabled adapter) and KTO's ("ref", a second
    adapter of the same PeftModel). Distillation's teacher is prepared by TRL with
    `accelerator.prepare_model(teacher, evaluation_mode=True)`, which under FSDP2 shards
    nothing (evaluation mode skips the wrapping): "fsdp2_distillation" keeps it whole;
    "fsdp2_distillation_sharded_teacher" also shards it (a user-sharded teacher), so that its
    head is a DTensor gathered by trainers.sharded under no_grad."""
    from torch.distributed.device_mesh import init_device_mesh

    from grpo_lce._dispatch import recording

    res = {}
    sft = sft_trainer(tok, tiny_model(tok, peft=True), out_dir, world, device=device)
    dev = sft.accelerator.device
    mesh = init_device_mesh(dev.type, (world,))
    fully_shard_like_accelerate(sft.model, mesh=mesh)
    head = _head_type(sft.model)
    inputs = to_device(rank_slice(batches["sft"], rank, world), dev)
    sft.model.zero_grad(set_to_none=True)
    with recording() as rec:
        loss = sft.compute_loss(sft.model, dict(inputs),
                                num_items_in_batch=batches["sft_num_items"].to(dev))
        loss.backward()
    res["fsdp2_sft"] = {"loss": loss.detach().cpu(), "synced": grads_of(sft.model),
                        "calls": len(rec.paths), "fallbacks": sorted(sft._lce_fallbacks_logged),
                        "head": head}
    runs = [(name, name, False) for name in _ddp_trainers.NAMES]
    runs.append(("distillation_sharded_teacher", "distillation", True))
    for key, name, shard_teacher in runs:
        tr = _ddp_trainers.build(name, tok, out_dir, world, device=device)
        fully_shard_like_accelerate(tr.model, mesh=mesh)
        head = _head_type(tr.model)
        if shard_teacher:
            fully_shard_like_accelerate(tr.teacher_model, mesh=mesh)
            head = f"{head}+teacher {_head_type(tr.teacher_model)}"
        inputs = to_device(batches[name]["ranks"][rank], dev)
        out = _ddp_trainers.step(tr, tr.model, inputs)
        out["synced"] = out.pop("grads")
        out["head"] = head
        res[f"fsdp2_{key}"] = out
    return res


def zero3_config(world: int) -> dict:
    """The DeepSpeed config of the ZeRO-3 scenarios: every parameter partitioned, fp32."""
    return {
        "train_micro_batch_size_per_gpu": B // world, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
    }


def zero3_engine(model, world: int):
    """`model` on a DeepSpeed ZeRO-3 engine (its parameters partitioned in place). No step is
    taken (lr 0): ZeRO-3 only needs an optimizer to partition the gradients into.
    deepspeed.init_distributed reuses the process group accelerate already set up."""
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=0.0),
                                      config=zero3_config(world))
    return engine


def _zero3_head(model) -> str:
    """What the LM head weight of `model` is between forwards: "partitioned frozen" (or
    "... trainable") for a released ZeRO-3 partitioned parameter (numel 0), which
    trainers.sharded must gather; else its type and size."""
    from trainers.models import unwrap_causal_lm
    from trainers.sharded import is_zero3_param

    w = unwrap_causal_lm(model).get_output_embeddings().weight
    if is_zero3_param(w) and w.numel() == 0:
        return f"partitioned {'trainable' if w.requires_grad else 'frozen'}"
    return f"{type(w).__name__} of numel {w.numel()}"


def zero3_step(tr, engine, inputs: dict, num_items=None) -> dict:
    """`_ddp_trainers.step` on a ZeRO-3 engine: `engine.backward` (which finishes ZeRO-3's
    reduce-scatter of the last gradient bucket), then each trainable parameter's averaged
    gradient read back whole (`safe_get_full_grad`, a collective: every rank walks the same
    names)."""
    from deepspeed.utils import safe_get_full_grad

    from grpo_lce._dispatch import recording

    tr._metrics["train"].clear()
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
    with recording() as rec:
        loss = tr.compute_loss(engine, dict(inputs), **kwargs)
        engine.backward(loss)
    grads = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)
            if g is not None:
                grads[n] = g.detach().to("cpu", copy=True)
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items()}
    return {"loss": loss.detach().cpu(), "synced": grads, "metrics": metrics,
            "calls": len(rec.paths), "fallbacks": sorted(tr._lce_fallbacks_logged)}


def _zero3_trainers(rank, world, tok, batches, out_dir, device):
    """Scenario zero3_trainers: SFT, DPO, KTO, RLOO and distillation (LoRA: frozen head) with
    the policy on a ZeRO-3 engine (`zero3_engine`), one step each on this rank's rows. DPO's
    reference (the disabled adapter) and KTO's ("ref", a second adapter of the same PeftModel)
    are the policy's own partitioned weights. Distillation's teacher is prepared as TRL 1.16's
    DistillationTrainer prepares it when DeepSpeed is on: `trl.models.utils.prepare_deepspeed`
    (its own ZeRO-3 engine, no optimizer, eval mode; every teacher weight partitioned too), so
    the teacher's head is gathered by trainers.sharded under no_grad."""
    from trl.models.utils import prepare_deepspeed

    res = {}
    cases = [("sft", None)] + [(name, name) for name in _ddp_trainers.NAMES]
    for key, name in cases:
        if name is None:
            tr = sft_trainer(tok, tiny_model(tok, peft=True), out_dir, world, device=device)
        else:
            tr = _ddp_trainers.build(name, tok, out_dir, world, device=device)
        dev = tr.accelerator.device
        engine = zero3_engine(tr.model, world)
        head = _zero3_head(engine.module)
        if name == "distillation":
            # what prepare_deepspeed reads of the accelerator: the ZeRO-3 config TRL would run
            plugin = types.SimpleNamespace(deepspeed_config=zero3_config(world))
            accel = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin))
            tr.teacher_model = prepare_deepspeed(tr.teacher_model, accel)
            head = f"{head}+teacher {_zero3_head(tr.teacher_model.module)}"
        if name is None:
            inputs = to_device(rank_slice(batches["sft"], rank, world), dev)
            out = zero3_step(tr, engine, inputs, batches["sft_num_items"].to(dev))
            del out["metrics"]  # the single-process SFT reference keeps none
        else:
            out = zero3_step(tr, engine, to_device(batches[name]["ranks"][rank], dev))
        out["head"] = head
        res[f"zero3_{key}"] = out
    res["zero3_refusals"] = _zero3_refusals(tok, out_dir, world, device)
    return res


def _zero3_refusals(tok, out_dir, world, device) -> dict:
    """GRPOTrainer and SFTTrainer built with a ZeRO-3 `deepspeed=` config (so accelerate's
    DeepSpeed plugin is on, stage 3): on a LoRA model (frozen head) the construction succeeds;
    on the full model (trainable head) it must be refused. {case: "built, stage 3" or the
    error's type and message}."""
    import trl
    from datasets import Dataset

    from trainers import SFTTrainer

    config = {**zero3_config(world), "train_micro_batch_size_per_gpu": "auto"}
    sft_args = {"output_dir": out_dir, "report_to": "none", "bf16": False,
                "use_cpu": device == "cpu", "save_strategy": "no",
                "per_device_train_batch_size": B // world, "deepspeed": config}
    out = {}
    for name, peft in (("grpo", True), ("sft", True), ("grpo", False), ("sft", False)):
        model = tiny_model(tok, peft=peft)
        key = f"{name}_{'lora' if peft else 'full'}"
        try:
            if name == "grpo":
                tr = grpo_trainer(tok, model, out_dir, world, device=device, deepspeed=config)
            else:
                tr = SFTTrainer(model=model, processing_class=tok, args=trl.SFTConfig(**sft_args),
                                train_dataset=Dataset.from_dict({"text": ["abc", "hi"] * 4}))
        except (ValueError, RuntimeError) as e:
            out[key] = f"{type(e).__name__}: {e}"
            continue
        stage = tr.accelerator.state.deepspeed_plugin.zero_stage if tr.is_deepspeed_enabled else None
        out[key] = f"built, stage {stage}"
    return out


def _zero3(rank, world, tok, batches, out_dir, device):
    from deepspeed.utils import safe_get_full_grad

    from trainers.models import unwrap_causal_lm
    from trainers.sharded import is_zero3_param

    tr = grpo_trainer(tok, tiny_model(tok, peft=True), out_dir, world, device=device,
                      loss_type="dapo")
    engine = zero3_engine(tr.model, world)
    head_w = unwrap_causal_lm(engine.module).get_output_embeddings().weight
    assert is_zero3_param(head_w) and head_w.numel() == 0 and not head_w.requires_grad, head_w
    inputs = to_device(rank_slice(batches["grpo"], rank, world), tr.accelerator.device)
    with fused_head_ran(tr):
        loss = tr.compute_loss(engine, dict(inputs))
        engine.backward(loss)
    grads = {n: safe_get_full_grad(p).detach().to("cpu", copy=True)
             for n, p in engine.module.named_parameters() if p.requires_grad}
    return {"zero3_lora": {"loss": loss.detach().cpu(), "synced": grads}}


def dist_backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else None


def _exact_fp32(device: str) -> None:
    """Full-fp32 GEMMs and deterministic cuDNN in this (worker) process: with TF32 the two sides
    would differ by ~1e-3 relative, not by summation order. Process-wide, hence only here, in
    processes this script owns."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _run(rank, world, port, out_dir, scenarios, device):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _exact_fp32(device)
    if device == "cuda":
        torch.cuda.set_device(rank)  # accelerate does the same (LOCAL_RANK); before any CUDA work
    from trainers.tiny import build_tokenizer

    tok = build_tokenizer()
    path = os.path.join(out_dir, "inputs.pt")  # grpo_fastgen alone needs no batches
    batches = torch.load(path, weights_only=False) if os.path.exists(path) else {}
    res = {}
    if "ddp" in scenarios:
        res.update(_ddp(rank, world, tok, batches, out_dir, device))
    if "grpo_fastgen" in scenarios:
        import _ddp_fastgen

        res.update(_ddp_fastgen.rank_results(rank, world, tok, out_dir, device))
    if "fsdp2" in scenarios:
        res.update(_fsdp2(rank, world, tok, batches, out_dir, device))
    if "fsdp2_trainers" in scenarios:
        res.update(_fsdp2_trainers(rank, world, tok, batches, out_dir, device))
    for name in _ddp_trainers.NAMES:
        if name in scenarios:
            res[name] = _ddp_trainers.rank_results(name, rank, world, tok, batches[name],
                                                   out_dir, device)
    if "ddp_nf4" in scenarios:
        import _ddp_nf4

        res.update(_ddp_nf4.rank_results(rank, world, tok, batches, out_dir, device))
    if "zero3" in scenarios:  # last: DeepSpeed leaves its own state in the process
        res.update(_zero3(rank, world, tok, batches, out_dir, device))
    if "zero3_trainers" in scenarios:  # last too, for the same reason
        res.update(_zero3_trainers(rank, world, tok, batches, out_dir, device))
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def reference(out_dir, device, world: int):
    """Single process, no process group: write DIR/inputs.pt (the trainers' batches split for
    `world` ranks) and the reference DIR/ref.pt, as the `runs` fixture of tests/test_ddp.py
    computes them (same builders, same order), each step also in fp64 (`trl_head_in_fp64`):
    the truth the tolerances measure the fp32 results against."""
    from _trainer_pairs import trl_head_in_fp64

    warnings.filterwarnings("ignore")
    _exact_fp32(device)
    from trainers.tiny import build_tokenizer

    tok = build_tokenizer()
    ref = {}
    tr = grpo_trainer(tok, tiny_model(tok, peft=True), out_dir, 1, device=device)
    dev = tr.accelerator.device
    ref["meta"] = {"device": str(next(tr.model.parameters()).device), "backend": dist_backend()}
    batches = {"grpo": grpo_batch(tok, tr), "sft": sft_batch(tok)}
    batches["sft_num_items"] = (batches["sft"]["labels"][:, 1:] != -100).sum()
    torch.save(batches, os.path.join(out_dir, "inputs.pt"))
    grpo_in = to_device(batches["grpo"], dev)
    for loss_type in LOSS_TYPES:
        tr.loss_type = loss_type
        tr._metrics["train"].clear()
        loss, grads = grpo_step(tr, tr.model, grpo_in)
        ref[f"grpo_{loss_type}"] = {"loss": loss, "grads": grads,
                                    "entropy": tr._metrics["train"]["entropy"][-1]}
        with trl_head_in_fp64(tr):
            ref[f"grpo_{loss_type}"]["fp64"] = grpo_step(tr, tr.model, grpo_in)
    sft = sft_trainer(tok, tiny_model(tok, peft=True), out_dir, 1, device=device)
    sft_args = (sft, sft.model, to_device(batches["sft"], dev), batches["sft_num_items"].to(dev))
    loss, grads = sft_step(*sft_args)
    with trl_head_in_fp64(sft):
        ref["sft"] = {"loss": loss, "grads": grads, "fp64": sft_step(*sft_args)}
    for peft in (False, True):
        tr_f = grpo_trainer(tok, tiny_model(tok, peft=peft), out_dir, 1, device=device,
                            loss_type="dapo")
        loss, grads = grpo_step(tr_f, tr_f.model, grpo_in)
        with trl_head_in_fp64(tr_f):
            fp64 = grpo_step(tr_f, tr_f.model, grpo_in)
        ref[f"fsdp2_{'lora' if peft else 'full'}"] = {"loss": loss, "grads": grads, "fp64": fp64}
    for name in _ddp_trainers.NAMES:  # same builders and order as tests/test_ddp.py's fixture
        t = _ddp_trainers.build(name, tok, out_dir, 1, device=device)
        batches[name] = _ddp_trainers.batches(name, tok, t, world)
        ref[name] = _ddp_trainers.reference_with_fp64(name, t, batches[name])
    import _ddp_nf4  # NF4 bases: quantized once here, the ranks load the saved checkpoints

    nf4_trainers, nf4_batches = _ddp_nf4.prepare(tok, out_dir, world, batches["sft"],
                                                 device=device)
    batches.update(nf4_batches)
    ref.update(_ddp_nf4.reference_results(nf4_trainers, batches, out_dir))
    torch.save(batches, os.path.join(out_dir, "inputs.pt"))
    torch.save(ref, os.path.join(out_dir, "ref.pt"))


def fastgen_reference(out_dir, device, world: int):
    """Single process, after the ranks: the grpo_fastgen reference on the global batch the
    ranks sampled (read from DIR/rank{r}.pt), written to DIR/ref_fastgen.pt
    (tests/_ddp_fastgen.py)."""
    import _ddp_fastgen

    warnings.filterwarnings("ignore")
    _exact_fp32(device)
    from trainers.tiny import build_tokenizer

    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
             for r in range(world)]
    ref = _ddp_fastgen.reference_results(build_tokenizer(), ranks, out_dir, device)
    torch.save(ref, os.path.join(out_dir, "ref_fastgen.pt"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory with inputs.pt; rank files go here")
    ap.add_argument("--port", type=int, help="free TCP port for the rendezvous")
    ap.add_argument("--nprocs", type=int, default=2, help="number of processes")
    ap.add_argument("--scenarios", default="ddp,fsdp2",
                    help="comma-separated: ddp, grpo_fastgen, fsdp2, fsdp2_trainers, zero3, "
                         "zero3_trainers, dpo, kto, rloo, distillation, ddp_nf4")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo; cuda: nccl, rank r on cuda:r")
    ap.add_argument("--reference", action="store_true",
                    help="write inputs.pt and the single-process ref.pt instead")
    ap.add_argument("--fastgen-reference", action="store_true",
                    help="after the ranks ran grpo_fastgen: write its single-process "
                         "ref_fastgen.pt from their rank files")
    args = ap.parse_args(argv)
    if args.fastgen_reference:
        fastgen_reference(args.out, args.device, args.nprocs)
        return
    if args.reference:
        reference(args.out, args.device, args.nprocs)
        return
    if args.port is None:
        ap.error("--port is required unless --reference")
    if args.device == "cuda" and torch.cuda.device_count() < args.nprocs:
        ap.error(f"--device cuda needs {args.nprocs} GPUs, {torch.cuda.device_count()} visible")
    torch.multiprocessing.spawn(
        _run, args=(args.nprocs, args.port, args.out, args.scenarios.split(","), args.device),
        nprocs=args.nprocs,
    )


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
