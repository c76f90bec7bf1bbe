"""Which pieces of a decode step run our decode kernels, decided once per model state.

    projections  q/k/v/o and gate/up/down of every layer: `decode_linear(x, module)` (the fused
                 bitsandbytes 4-bit + LoRA kernel; cuBLAS in PEFT's order for a dense base) where
                 `linear4bit.unsupported_reason(module)` is None, the module's own call otherwise
    norms        each residual add + RMSNorm pair (the decoder layer's two, and the last layer's
                 add with the final norm): `add_rmsnorm`, when every such norm is LlamaRMSNorm's
                 forward; transformers' modules otherwise
    embed        each decode step's embedding lookup inside the first layer's input norm
                 (`add_rmsnorm(..., ids=)`), where the norms run there and the input embedding
                 is a plain nn.Embedding (no max_norm)
    groups       the projections of one input, q/k/v and gate/up of each layer, in one launch
                 of the fused kernel (`decode_linears`) where all of them take it and
                 `linear4bit.group_modules_reason` accepts them together; a gate/up group whose
                 MLP's act_fn is SiLU also forms silu(gate) · up in that launch
                 (`decode_silu_mul`) where `linear4bit.silu_mul_modules_reason` accepts it
    sample       the sampling step's reductions over the vocabulary (log-sum-exp, the race or
                 the argmax, the token's log-prob): `race_sample`, split over programs
    record       after sampling, the token's record (pad for finished rows, the column write)
                 and the row state (slot, EOS, current token, step) in one launch:
                 `record_step`, the same integer results as its torch ops
    head         each decode step's LM head: `head_logits`, where `head_logits.head_reason`
                 accepts the output embeddings (a plain 16-bit nn.Linear without bias), so a
                 captured step holds no cuBLAS call of its own
    attention    each decode step's attention: `decode_attention` (split-K over each row's valid
                 keys, GQA without expanding K and V, the splits combined in the same launch),
                 where the head dim is a power of two >= 16; SDPA over the whole masked cache
                 otherwise
    rope         each decode step's RoPE of q and k (after Qwen3's q_norm / k_norm, fused) with
                 the write of k and v into the cache: `rope_cache_write`, one launch per layer,
                 when the rotary dim is the head dim and any q/k norm is LlamaRMSNorm's forward
    rope_attention  each decode step's RoPE, cache write and attention in one launch
                 (`decode_attention.rope_attention`), where both `rope` and `attention` run,
                 the attention has no q/k norms (Qwen3's stay in `rope_cache_write`) and the
                 hidden states are 16-bit
    rope_sums    a fused q/k/v launch that splits K leaves its partials to `rope_cache_write`,
                 which sums them (the same bits; `kernels.split_sum`): the projection's programs
                 skip the arrival counter and the re-read, where the rope kernel runs
    norm_sums    the same for o_proj and down_proj into `add_rmsnorm`, wherever the fused norm
                 runs
    lora_t       a gate/up group (LORA_T_GROUPS) with LoRA whose launch takes t = x @ Aᵀ from
                 the `add_rmsnorm` before it (`kernels.lora_t`), where the norms run there and
                 `linear4bit_ws.given_t_reason` accepts the device, the batch and the factors
                 (the warp-specialized kernel, which otherwise forms t in every tile)

Only decode steps use the projections' and the RoPE kernels (M = batch rows, the projection
kernel's small-M regime); the prefill's B·S rows go through the modules (bitsandbytes dequantizes
once per GEMM there), and so do the projections of a decode batch above FUSED_LINEAR_MAX_ROWS
rows, the most the fused kernel was measured faster than bitsandbytes' dequantize + GEMM at
(bench/README.md).
kernels="torch" uses none of them; "auto" uses them on KERNEL_DEVICES.
A plan is made once per model state and decode batch (the loop keys it by the same fingerprint as
its graphs and the batch: a disabled adapter or train mode changes what `decode_linear` supports)
and says in one line which path the projections take.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import activations

from .kernels import linear4bit, linear4bit_ws
from .kernels._interp import interpreting
from .kernels.head_logits import head_reason
from .kernels.rmsnorm import rmsnorm_params
from .kernels.rope import norm_params

KERNELS = ("auto", "torch")
KERNEL_DEVICES = ("cuda",)  # where "auto" uses the kernels (CPU tests add "cpu": the interpreter)
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
# the groups (by their first projection) whose LoRA t the norm before them forms: gate/up,
# whose launch saves more than the norm spends on t; q/k/v's launch saves less (bench/README.md)
LORA_T_GROUPS = ("gate_proj",)
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
# decode batches up to this many rows take the fused projection: faster than bitsandbytes +
# PEFT at 8 and 64 rows at the 1B and 8B layer shapes (at one row only at 1B), not measured
# above 64 (bench/README.md)
FUSED_LINEAR_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    fused: frozenset = frozenset()  # id() of the projection modules decode_linear serves
    split_mlp: frozenset = frozenset()  # id() of the LlamaMLP-style MLPs run projection by projection
    groups: frozenset = frozenset()  # tuples of the id()s of projections run in one launch
    silu_mul: frozenset = frozenset()  # id() of MLPs whose gate/up launch forms silu(gate)·up
    norms: bool = False  # residual add + RMSNorm by add_rmsnorm
    embed: bool = False  # decode steps: the embedding lookup inside layer 0's add_rmsnorm
    rope: bool = False  # decode steps: (q/k norm +) RoPE + cache write by rope_cache_write
    sample: bool = False  # the sampling reductions by race_sample
    record: bool = False  # the step's token record and row state by record_step
    head: bool = False  # decode steps: the LM head by head_logits
    attention: bool = False  # decode steps: attention by decode_attention
    rope_sums: bool = False  # split q/k/v partials summed by rope_cache_write
    rope_attention: bool = False  # decode steps: RoPE + cache write + attention in one launch
    norm_sums: bool = False  # split o/down partials summed by add_rmsnorm
    # groups (as in `groups`) whose LoRA t = x @ Aᵀ the add_rmsnorm before them forms
    lora_t: frozenset = frozenset()
    line: str = "kernels off (kernels='torch')"

    @property
    def active(self) -> bool:
        return bool(self.fused) or self.norms or self.embed or self.rope or self.sample or \
            self.record or self.head or self.attention


TORCH = KernelPlan()


def _norm_reason(base) -> str | None:
    inner = base.model
    norms = [inner.norm]
    for layer in inner.layers:
        norms += [getattr(layer, "input_layernorm", None),
                  getattr(layer, "post_attention_layernorm", None)]
    for norm in norms:
        try:
            rmsnorm_params(norm)
        except (ValueError, AttributeError) as exc:
            return str(exc)
    return None


def _rope_reason(base) -> str | None:
    """Why rope_cache_write cannot serve `base`'s decode steps, or None. transformers' Llama,
    Qwen2, Qwen3 and Mistral attention rotate the whole head (`apply_rotary_pos_emb` over D), so
    a rotary dim below the head dim (a partial_rotary_factor < 1) is left to the modules' ops,
    as are q/k norms of another form and norm weights in a third dtype."""
    rotary = 2 * base.model.rotary_emb.inv_freq.numel()
    dtype = base.model.embed_tokens.weight.dtype  # the hidden stream's dtype
    for i, layer in enumerate(base.model.layers):
        attn = layer.self_attn
        if rotary != attn.head_dim:
            return f"rotary dim {rotary} != head dim {attn.head_dim} (partial rotary)"
        try:
            norms = norm_params(attn)
        except (ValueError, AttributeError) as exc:
            return f"layer {i} q/k norm: {exc}"
        for name, (w, _) in zip(("q_norm", "k_norm"), norms or ()):
            if w.dtype not in (dtype, torch.float32) or w.shape != (attn.head_dim,):
                return (f"layer {i} {name} weight is {tuple(w.shape)} {w.dtype} "
                        f"(hidden states {dtype})")
        if norms and norms[0][0].dtype != norms[1][0].dtype:
            return f"layer {i} q_norm and k_norm weights differ in dtype"
    return None


def _attention_reason(base) -> str | None:
    """Why `decode_attention` cannot serve `base`'s decode steps, or None: its tiles need a
    power-of-two head dim of at least 16 (Llama, Qwen and Mistral have 64 or 128)."""
    D = base.model.layers[0].self_attn.head_dim if base.model.layers else 0
    if D < 16 or D & (D - 1):
        return f"head dim {D} is not a power of two >= 16"
    return None


def _mlp_ok(mlp) -> bool:
    """LlamaMLP's forward: down(act(gate(x)) · up(x)) (Qwen2 / Qwen3 / Mistral share it)."""
    return all(hasattr(mlp, n) for n in (*MLP_PROJ, "act_fn")) and \
        type(mlp).__name__ in ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


# transformers' SiLU activations: forward = F.silu
SILU = tuple(c for c in (torch.nn.SiLU, getattr(activations, "SiLUActivation", None)) if c)


def _is_silu(act) -> bool:
    return type(act) in SILU


def make_plan(base, kernels: str, device_type: str, batch: int = 1) -> KernelPlan:
    """The plan for transformers causal LM `base` (its PEFT layers included) on `device_type`,
    decoding `batch` rows per step."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS}")
    if kernels == "torch":
        return TORCH
    if device_type not in KERNEL_DEVICES or (device_type != "cuda" and not interpreting()):
        return KernelPlan(line=f"kernels off (the model is on {device_type!r}; they run on "
                               f"{' / '.join(KERNEL_DEVICES)})")
    fused, split_mlp, first_reason, total, packed = set(), set(), None, 0, 0
    groups, group_reason, silu_mul, lora_t = set(), None, set(), set()
    dtype = base.model.embed_tokens.weight.dtype  # the projections' input dtype
    device = base.model.embed_tokens.weight.device
    rows_reason = (None if batch <= FUSED_LINEAR_MAX_ROWS else
                   f"batch {batch} > {FUSED_LINEAR_MAX_ROWS} rows, the most the fused kernel is "
                   "measured faster than bitsandbytes' dequantize + GEMM at")
    for i, layer in enumerate(base.model.layers):
        mods = [(n, getattr(layer.self_attn, n)) for n in ATTN_PROJ]
        mlp_ok = _mlp_ok(layer.mlp)
        if mlp_ok:
            mods += [(n, getattr(layer.mlp, n)) for n in MLP_PROJ]
            split_mlp.add(id(layer.mlp))
        elif first_reason is None:
            first_reason = f"layer {i} mlp is {type(layer.mlp).__name__}"
        for name, mod in mods:
            total += 1
            reason = rows_reason or linear4bit.unsupported_reason(mod)
            if reason is None:
                fused.add(id(mod))
                packed += linear4bit._is_linear4bit(linear4bit._resolve_lora(mod).base)
            else:
                first_reason = first_reason or f"layer {i} {name}: {reason}"
        named = dict(mods)
        for names in (ATTN_PROJ[:3], MLP_PROJ[:2] if mlp_ok else ()):
            group = [named[n] for n in names]
            if not group or not all(id(m) in fused for m in group):
                continue
            reason = linear4bit.group_modules_reason(group, dtype)
            if reason is None:
                groups.add(tuple(id(m) for m in group))
                t_reason = linear4bit_ws.given_t_reason(
                    device, batch, linear4bit.lora_factors(group))
                if t_reason is None and names[0] in LORA_T_GROUPS:
                    lora_t.add(tuple(id(m) for m in group))
                if names[0] == "gate_proj" and _is_silu(layer.mlp.act_fn) and \
                        linear4bit.silu_mul_modules_reason(*group, dtype) is None:
                    silu_mul.add(id(layer.mlp))
            else:
                group_reason = group_reason or f"layer {i} {'/'.join(names)}: {reason}"
    norm_reason = _norm_reason(base)
    line = (f"{len(fused)} of {total} projections through decode_linear ({packed} by the fused "
            f"4-bit + LoRA kernel, {len(fused) - packed} dense by cuBLAS)")
    if first_reason is not None:
        line += f", the rest as module calls (first: {first_reason})"
    if groups or group_reason:
        line += f"; {len(groups)} q/k/v or gate/up groups in one launch each"
        line += f" ({len(silu_mul)} gate/up with silu · mul)" if silu_mul else ""
        line += "" if group_reason is None else f" (not grouped: {group_reason})"
    embed = base.get_input_embeddings()
    embed_ok = norm_reason is None and bool(base.model.layers) and \
        type(embed) is torch.nn.Embedding and embed.max_norm is None
    line += ("; residual add + RMSNorm by add_rmsnorm" if norm_reason is None
             else f"; RMSNorm by the modules ({norm_reason})")
    if norm_reason is not None:
        lora_t = set()  # t comes from add_rmsnorm only
    elif lora_t:
        line += f" (with LoRA's x @ Aᵀ of {len(lora_t)} groups)"
    line += " (the first with the embedding lookup)" if embed_ok else ""
    rope_reason = _rope_reason(base)
    has_norms = hasattr(base.model.layers[0].self_attn, "q_norm") if base.model.layers else False
    line += ("; " + ("q/k norm + " if has_norms else "") + "RoPE + cache write by rope_cache_write"
             if rope_reason is None else f"; RoPE by torch ops ({rope_reason})")
    rope_sums = bool(fused) and rope_reason is None
    norm_sums = bool(fused) and norm_reason is None
    if rope_sums or norm_sums:
        line += "; split-K " + " and ".join(
            what for what, on in (("q/k/v summed by rope_cache_write", rope_sums),
                                  ("o/down summed by add_rmsnorm", norm_sums)) if on)
    line += "; sampling reductions by race_sample; the step's record by record_step"
    attention = _attention_reason(base)
    line += ("; attention by decode_attention" if attention is None
             else f"; attention by SDPA over the cache ({attention})")
    rope_attention = (rope_reason is None and attention is None and not has_norms
                      and dtype in (torch.bfloat16, torch.float16))
    if rope_attention:
        line += " (with RoPE and the cache write in its launch)"
    head = head_reason(base.get_output_embeddings(), dtype)
    line += "; LM head by head_logits" if head is None else f"; LM head by the module ({head})"
    if not fused:
        split_mlp = set()  # nothing to gain from running the MLP piecewise
    return KernelPlan(frozenset(fused), frozenset(split_mlp), frozenset(groups),
                      frozenset(silu_mul), norms=norm_reason is None, embed=embed_ok,
                      rope=rope_reason is None, sample=True, record=True, head=head is None,
                      attention=attention is None,
                      rope_sums=rope_sums, norm_sums=norm_sums, lora_t=frozenset(lora_t),
                      rope_attention=rope_attention,
                      line=line)
