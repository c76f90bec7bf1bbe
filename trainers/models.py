"""The causal LM inside whatever wraps it: DDP, DataParallel, FSDP1, DeepSpeed, torch.compile,
accelerate and PEFT. The trainers and `trainers.head` find the `*ForCausalLM`, its backbone and
its output embeddings through these functions, so each wrapper is handled in one place.
"""

from __future__ import annotations

import sys

import torch

try:  # PEFT is optional for the trainers: plain full fine-tuning does not need it
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
except ImportError:  # pragma: no cover - exercised only without peft
    PeftModel = BaseTunerLayer = AuxiliaryTrainingWrapper = ()


def _container_types() -> tuple[type, ...]:
    """The wrappers that hold the model as `.module`: DDP, DataParallel, FSDP1 and DeepSpeed's
    engine (the last two only when their package is already imported, as it is when in use)."""
    types = [torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is not None:
        types.append(fsdp.FullyShardedDataParallel)
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "DeepSpeedEngine"):
        types.append(deepspeed.DeepSpeedEngine)
    return tuple(types)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DataParallel / FSDP1 / DeepSpeed / torch.compile wrappers: what
    accelerate's `extract_model_from_parallel(model, keep_torch_compile=False)` returns, without
    its per-call cost (it re-reads package metadata and walks every submodule on each call, and
    the trainers call it several times a step)."""
    containers = _container_types()
    compiled = torch._dynamo.eval_frame.OptimizedModule  # what torch.compile(module) returns
    while True:
        if isinstance(model, containers):
            model = model.module
        elif isinstance(model, compiled):
            model = model._orig_mod
        elif "_orig_mod" in model.__dict__:  # a module whose regions were compiled in place
            model = model.__dict__["_orig_mod"]
        else:
            return model


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The `*ForCausalLM` inside DDP / DataParallel / torch.compile / accelerate / PEFT wrappers."""
    m = unwrap_model(model)
    if PeftModel and isinstance(m, PeftModel):
        m = m.get_base_model()
    return m


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output's `last_hidden_state` feeds the LM head (TRL reads the same one)."""
    lm = unwrap_causal_lm(model)
    base = getattr(lm, "base_model", None)
    if base is None or base is lm:
        raise ValueError(
            f"model ({type(lm).__name__}) has no backbone under `base_model`: the fused head "
            "supports transformers `*ForCausalLM` models (backbone + lm_head)"
        )
    return base
