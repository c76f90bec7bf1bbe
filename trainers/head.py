"""The final hidden states and the LM head of a causal LM, however it is wrapped, without logits.

Both trainers need the same two things from the model they are handed (a plain
`*ForCausalLM`, a `PeftModel` around one, possibly 4-bit, possibly inside DDP or accelerate's
wrappers, possibly with gradient checkpointing on):

    h (B, L, H)   the backbone's last hidden state (after the final norm), with autograd history
    W (V, H), b   the LM head weight and bias, read from the base model's output embeddings

and then z = (h Wᵀ + b) / τ is handled by `grpo_lce` in chunks, never as (B, L, V).

How h is obtained. The top-level model (the wrapper TRL hands us) is still the one called, so
DDP's forward bookkeeping, accelerate's autocast/fp32 wrappers, PEFT's adapter routing
(`disable_adapter()` for the reference pass) and gradient checkpointing behave exactly as in
stock TRL. A forward hook on the backbone (`causal_lm.base_model`, the `LlamaModel` inside
`LlamaForCausalLM`: the module whose output TRL's own fused head reads) records its
`last_hidden_state` for the duration of that one call only. The call passes
`logits_to_keep=1` (when the model's forward takes it, as every recent transformers causal LM
does), so the model's own head projects one position per row (B · V logits, a rounding error
next to the (B · L, V) it would build otherwise), and no labels, so it computes no loss. No
hook exists outside that call, so generation is untouched.

Why not the alternatives: `output_hidden_states=True` keeps every layer's activations in the
output and, across transformers versions, does not consistently return the normed last one;
calling the backbone directly would skip the DDP wrapper's forward (gradients would then not
be synchronised); replacing `model.forward` is what TRL does and what the house style avoids.

What this refuses (`check_fused_head`): an LM head that carries a PEFT adapter
(`target_modules` or `modules_to_save` including it: its trainable copy would be ignored),
a quantized LM head (bitsandbytes `Params4bit` / `Int8Params`), models without output
embeddings or without a backbone. `fused_head_unsupported_reason` names model features the
head math here does not reproduce (final-logit softcapping, logit scaling); the trainers fall
back to TRL's own fused head for those.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch

from grpo_lce import FLOAT_DTYPES, linear_cross_entropy, linear_logprobs

from .models import (
    AuxiliaryTrainingWrapper,
    BaseTunerLayer,
    backbone,
    unwrap_causal_lm,
)
from .sharded import full_head_params

# Config attributes under which transformers models scale or cap the logits before the softmax
# (Gemma 2/3 softcapping; Cohere, Granite, Falcon-H1, MiniCPM, HyperCLOVA X scaling). TRL's fused
# head reproduces them; `grpo_lce` computes plain (h Wᵀ + b) / τ, so such models fall back.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
    "logits_scaling",
)


def lm_head_params(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (V, H), bias (V,) or None) of the base model's output embeddings (tied or not),
    as full plain tensors: gathered when FSDP2 (DTensor) or ZeRO-3 shards them, see
    `trainers.sharded`. Call it once per loss: each call under those backends is an all-gather."""
    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    return full_head_params(head.weight, getattr(head, "bias", None), model=lm)


def check_fused_head(model: torch.nn.Module) -> None:
    """Raise ValueError, naming the problem and the fix, for setups the fused head cannot serve."""
    lm = unwrap_causal_lm(model)
    name = type(lm).__name__
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if head is None:
        raise ValueError(
            f"model ({name}) has no output embeddings (`get_output_embeddings()` is None): the "
            "fused head needs a causal LM with an `lm_head`; pass an `AutoModelForCausalLM` model"
        )
    if (BaseTunerLayer and isinstance(head, BaseTunerLayer)) or (
        AuxiliaryTrainingWrapper and isinstance(head, AuxiliaryTrainingWrapper)
    ):
        raise ValueError(
            f"the LM head of {name} carries a PEFT adapter ({type(head).__name__}): the fused head "
            "multiplies the hidden states by the base `lm_head.weight` directly, so the adapter "
            "(or the `modules_to_save` copy) would be silently ignored. Remove 'lm_head' from "
            "`target_modules` and `modules_to_save` in your peft config."
        )
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"the LM head of {name} ({type(head).__name__}) has no `weight` tensor")
    if hasattr(weight, "quant_state") or hasattr(weight, "SCB") or not weight.is_floating_point():
        raise ValueError(
            f"the LM head of {name} is quantized ({type(weight).__name__}, dtype {weight.dtype}): "
            "the fused head needs a float weight. Keep the head unquantized, e.g. "
            "BitsAndBytesConfig(llm_int8_skip_modules=['lm_head']) (transformers' default)."
        )
    # a ZeRO-3 partitioned weight is numel 0 outside its forward; ds_shape is its real shape
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    if len(shape) != 2:
        raise ValueError(
            f"the LM head weight of {name} has shape {shape}, expected (V, H); FSDP1 flat "
            "parameters are not supported (use FSDP2)"
        )
    backbone(model)


def check_parallelism(trainer) -> None:
    """Refuse the sharded-parameter setups whose LM head cannot be gathered for the fused head.

    Supported: DDP, DeepSpeed ZeRO-1/2, FSDP2 (`fsdp_version: 2`, the head is a DTensor,
    gathered differentiably) and ZeRO-3 with a frozen head (gathered and copied); see
    `trainers.sharded`. Refused: FSDP1 (flat parameters: `lm_head.weight` outside the forward is
    a view into a flat shard), FSDP2 with CPU offload (the shard lives on the CPU, the all-gather
    would run on the GPU process group), and ZeRO-3 with a trainable head.
    """
    name = type(trainer).__name__
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        version = getattr(plugin, "fsdp_version", 1)
        if version != 2:
            raise ValueError(
                f"trainers.{name} does not support FSDP1 (fsdp_version={version}): its flat "
                "parameters leave only a shard of the LM head weight outside the module's forward. "
                f"Use FSDP2 (fsdp_config={{'fsdp_version': 2}}, or `fsdp_version: 2` in the "
                f"accelerate config), DDP, or trl.{name}."
            )
        if type(getattr(plugin, "cpu_offload", None)).__name__ == "CPUOffloadPolicy":
            raise ValueError(
                f"trainers.{name} does not support FSDP2 with cpu_offload (fsdp_offload_params): "
                "the LM head shard lives on the CPU, where the fused head cannot gather it. Turn "
                f"offloading off, or use trl.{name}."
            )
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = trainer.accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            # the reference model only runs under no_grad: its head may stay "trainable"
            head = unwrap_causal_lm(trainer.model).get_output_embeddings()
            params = (head.weight, getattr(head, "bias", None))
            if any(p is not None and p.requires_grad for p in params):
                raise ValueError(
                    f"trainers.{name} supports DeepSpeed ZeRO-3 only with a frozen LM head "
                    "(LoRA / QLoRA): a trainable head's gradient would bypass ZeRO-3's "
                    f"partitioned reduction. Use ZeRO-2, FSDP2, or trl.{name}."
                )


def head_dtype_reason(weight: torch.Tensor, owner: str = "the") -> str | None:
    """Why `grpo_lce`'s ops cannot take `owner`'s LM head weight (a dtype outside
    `grpo_lce.FLOAT_DTYPES`, e.g. float64), or None."""
    if weight.dtype in FLOAT_DTYPES:
        return None
    return f"{owner} LM head is {weight.dtype}; grpo_lce computes in float32, bfloat16 or float16"


def fused_head_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `grpo_lce`'s plain (h Wᵀ + b) / τ would not match this model's logits (or cannot
    compute them: a head in a dtype the ops do not take, e.g. float64), or None."""
    lm = unwrap_causal_lm(model)
    weight = getattr(lm.get_output_embeddings(), "weight", None)
    reason = None if weight is None else head_dtype_reason(weight)
    if reason is not None:
        return reason
    config = lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(text_config, attr, None)
        if value is not None and value != 1.0:
            return f"{type(text_config).__name__}.{attr}={value} transforms the logits"
    return None


@contextlib.contextmanager
def _record_backbone_output(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the backbone's last hidden state for every call made inside the block."""
    seen: list[torch.Tensor] = []

    def hook(_module, _args, output):
        hidden = getattr(output, "last_hidden_state", None)
        seen.append(output[0] if hidden is None else hidden)

    handle = backbone(model).register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@functools.lru_cache(maxsize=None)
def _accepts_logits_to_keep(model_cls: type) -> bool:
    """Whether `model_cls.forward` takes `logits_to_keep` (every transformers causal LM since
    4.50 does; for the others the logits are built and dropped: correct, just not lean)."""
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def forward_hidden_states(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, object]:
    """Call `model(**inputs)` (the wrapper itself) and return (h (B, L, H), the model's output).

    `inputs` must not hold labels (the model would compute a loss on one logit per row).
    h keeps its autograd history, so a loss built on it trains whatever the wrapper trains.
    """
    if "labels" in inputs:
        raise ValueError("forward_hidden_states: pass the labels to the head, not to the model")
    seq_len = inputs["input_ids"].shape[-1] if "input_ids" in inputs else None
    if _accepts_logits_to_keep(type(unwrap_causal_lm(model))):
        # the model's own lm_head then projects one row per sequence, not (B·L, V)
        inputs["logits_to_keep"] = 1
    with _record_backbone_output(model) as seen:
        outputs = model(**inputs, use_cache=False)
    if len(seen) != 1:
        raise RuntimeError(
            f"expected the backbone of {type(unwrap_causal_lm(model)).__name__} to run once per "
            f"forward, it ran {len(seen)} times"
        )
    hidden = seen[0]
    if seq_len is not None and hidden.shape[1] != seq_len:
        # Prompt-tuning PEFT prepends virtual tokens to every row; the real tokens come last.
        if hidden.shape[1] < seq_len:
            raise RuntimeError(
                f"backbone returned {hidden.shape[1]} positions for {seq_len} input tokens"
            )
        hidden = hidden[:, -seq_len:]
    return hidden, outputs


def head_inputs(hidden, weight, bias):
    """hidden on the head's device and in its dtype (the GEMM operands must agree; with an fp32
    head under bf16 autocast this upcasts h, as TRL's `cast_lm_head_to_fp32` does)."""
    hidden = hidden.to(device=weight.device, dtype=weight.dtype)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    return hidden, bias


def head_logprobs(hidden, weight, bias, targets, **kwargs):
    """`grpo_lce.linear_logprobs` on (hidden, weight, bias) with autocast off: the head's
    precision is fixed by grpo_lce (fp32 accumulation), not by an enclosing autocast region."""
    hidden, bias = head_inputs(hidden, weight, bias)
    with torch.autocast(hidden.device.type, enabled=False):
        return linear_logprobs(hidden, weight, targets.to(weight.device), bias=bias, **kwargs)


def head_cross_entropy(hidden, weight, bias, labels, **kwargs):
    """`grpo_lce.linear_cross_entropy` with the same device/dtype/autocast handling."""
    hidden, bias = head_inputs(hidden, weight, bias)
    with torch.autocast(hidden.device.type, enabled=False):
        return linear_cross_entropy(hidden, weight, labels.to(weight.device), bias=bias, **kwargs)
