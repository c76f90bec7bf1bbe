"""TRL's fused-LM-head forward, computed by `grpo_lce`: the one seam of the DPO, KTO and RLOO
trainers (why this seam, and how it meets accelerate: docs/DESIGN.md, "Trainers").

TRL 1.16 gets every log-prob of these trainers from `model(**inputs, labels=ℓ,
fused_lm_head=True)` → `FusedCausalLMOutput`, through the instance attribute `model.forward`
its `add_fused_lm_head` set. `install(trainer)` replaces that attribute on exactly the models
TRL patched, keeping TRL's forward as the fallback and for calls without `fused_lm_head`. With
labels ℓ (B, L) and the τ and `outputs` TRL patched the model with:

    h = backbone(**inputs).last_hidden_state       (B, L, H)   the same call TRL makes
    y_t = ℓ_{t+1} for t < L−1, −100 at t = L−1     (or y = shift_labels as given)
    logp, H, argmax = linear_logprobs(h, W, y, bias=b, temperature=τ, ...)   (B, L) fp32

and each field, (B, L − 1) (or (B, L) with `shift_labels`), 0 / False where y = −100:

    log_probs, entropy   logp, H (differentiable; an all-masked batch stays in the graph)
    is_top1              argmax == y (the first maximum: TRL's rule for ties)
    mean_logits          (h · w̄ + b̄) / τ, w̄ = Σ_v W_v / V in fp32; no gradient
    log_sum_sq_probs     lse(2d) − 2 lse(d), d = z − max z (WPO only: a second, no-grad pass)
    label_mask           y != −100
    loss                 −Σ logp / (num_items_in_batch, or the label count clamped to ≥ 1)

Packed (`packing=`, `max_packed_tokens=`): the labelled rows' valid tokens
(`trainers.packing.plan_target_packs`) where `trainers.attention` decides the model packs; a
call with inputs beyond ids and mask stays padded. Falls back to TRL's forward, one logged line
per reason: MoE router logits, logits softcapped or scaled, multimodal inputs, no labels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import weakref

import torch
from accelerate.utils import get_mixed_precision_context_manager
from accelerate.utils.operations import ConvertOutputsToFp32
from trl.trainer.utils import FusedCausalLMOutput

from grpo_lce import chunked_linear, default_chunk_size

from .base import PackingOptionsMixin
from .head import check_fused_head, fused_head_unsupported_reason, head_logprobs, lm_head_params
from .models import unwrap_causal_lm, unwrap_model
from .packing import packed_hidden, plan_target_packs, unpack

logger = logging.getLogger(__name__)

# Model inputs that carry images, video or audio: the trainers fall back to TRL's head for them
# (as trainers.GRPOTrainer does), whose VLM handling this module does not reproduce.
_MULTIMODAL_INPUTS = (
    "pixel_values", "pixel_values_videos", "pixel_attention_mask", "image_grid_thw",
    "video_grid_thw", "image_sizes", "spatial_shapes", "image_position_ids", "mm_token_type_ids",
    "input_features", "input_values", "audio_values",
)
# The model inputs a packed forward reproduces: the ids, the mask it replaces, and use_cache
# (off in a packed call too). A call with anything else (position_ids, inputs_embeds, a cache,
# token types) runs padded.
_PACKABLE_INPUTS = frozenset({"input_ids", "attention_mask", "use_cache"})
# The options of TRL's `_fused_forward`, read from its closure when we install.
_TRL_OPTIONS = ("temperature", "outputs")
_UNPACKABLE = (
    "grpo_lce packing skipped for a batch whose attention_mask is not one contiguous run per row, "
    "or whose labels are scored at padding positions; using padded forwards."
)
# Rows of h upcast to fp32 at a time for mean_logits: 32 MiB of fp32 at H = 4096.
_MEAN_ROWS_BYTES = 32 * 2**20


def _is_trl_fused(forward) -> bool:
    """Whether `forward` is TRL's `_fused_forward` bound to a model. Recognised by its code
    object, which `functools.wraps` leaves alone."""
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    return (code is not None and code.co_name == "_fused_forward"
            and code.co_filename.replace("\\", "/").endswith("trl/trainer/utils.py"))


def trl_fused_forward(model: torch.nn.Module) -> tuple[types.MethodType, object] | None:
    """(TRL's `_fused_forward` bound to `model`, the forward a call to `model` runs), or None.

    The two are the same (the instance attribute `add_fused_lm_head` set) unless accelerate
    prepared the model under mixed precision after TRL patched it (TRL does so for `ref_model`
    in its `__init__`): then the instance attribute is accelerate's autocast + fp32-outputs
    wrapper around TRL's forward, which accelerate keeps as `model._original_forward`."""
    forward = model.__dict__.get("forward")
    if _is_trl_fused(forward):
        return forward, forward
    original = model.__dict__.get("_original_forward")
    wrapper = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if _is_trl_fused(original) and isinstance(wrapper, ConvertOutputsToFp32):
        return original, forward
    return None


def _trl_options(forward: types.MethodType) -> dict:
    """{"temperature": τ, "outputs": (...)}: what TRL's `add_fused_lm_head` was called with."""
    func = forward.__func__
    cells = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=True))
    missing = [name for name in _TRL_OPTIONS if name not in cells]
    if missing:
        raise RuntimeError(
            f"TRL's fused LM head forward has no {missing} option: this TRL is not the 1.16 "
            "series the trainers were written against; use the stock TRL trainer")
    return {name: cells[name].cell_contents for name in _TRL_OPTIONS}


class FusedForwardMixin(PackingOptionsMixin):
    """Mixed in before `trl.RLOOTrainer`, `trl.DPOTrainer` or `trl.KTOTrainer`: the packing
    options (`trainers.base.PackingOptionsMixin`: `packing=`, `max_packed_tokens=`), and our
    forward installed after TRL's `__init__` (subclasses whose TRL class precomputes reference
    log-probs inside its `__init__` call `install` there first)."""

    _trl_fallback = "TRL's own fused head"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install(self)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        # TRL's DPO and KTO call this from their __init__, after patching the models: ours go in
        # first (TRL's RLOO has no such pass and never calls it)
        install(self)
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def _lce_packing_kind(self, lm, args, kwargs) -> str | None:
        """How to pack this call of `lm` ("varlen", "block", "sdpa_varlen", "dense"), or None
        for the padded backbone pass; notes why not, once per reason."""
        if self.packing is False or kwargs.get("attention_mask") is None:
            return None  # nothing asked, or nothing to pack (padding-free already)
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in
                       _PACKABLE_INPUTS)
        if args or extra or kwargs.get("input_ids") is None:
            what = ", ".join(extra) or "positional or embedding inputs"
            self._lce_packing_note(f"grpo_lce packing off for forwards with {what}; using "
                                   "padded forwards.")
            return None
        return self._lce_packing_for(lm)


def install(trainer) -> None:
    """Put our fused forward on the models TRL patched: the policy's causal LM and, when there
    is one, `trainer.ref_model`. Idempotent: a model already carrying ours is left as is.
    Raises (naming the problem) when TRL did not patch a model it should have."""
    targets = [("model", unwrap_causal_lm(trainer.model))]
    if getattr(trainer, "ref_model", None) is not None:
        # TRL patches the reference as given (not its base model under PEFT)
        targets.append(("ref_model", unwrap_model(trainer.ref_model)))
    for name, lm in targets:
        # ours already, possibly since wrapped by accelerate for mixed precision (`train()`
        # prepares the policy after we install; DPO / KTO install again from `evaluate`)
        if any(getattr(lm.__dict__.get(k), "grpo_lce_fused", False)
               for k in ("forward", "_original_forward")):
            continue
        found = trl_fused_forward(lm)
        if found is None:
            raise RuntimeError(
                f"trainers.{type(trainer).__name__}: TRL did not put its fused LM head on "
                f"{name} ({type(lm).__name__}); this TRL is not the 1.16 series the trainers "
                "were written against")
        trl_forward, current = found
        # Under accelerate's mixed-precision wrapper, ours enters the same autocast itself:
        # the wrapper stays as the fallback (TRL's forward inside it), so it is not around ours.
        amp = None if current is trl_forward else functools.partial(
            get_mixed_precision_context_manager, True, trainer.accelerator.autocast_handler)
        check_fused_head(lm)
        lm.forward = _make_forward(lm, current, _trl_options(trl_forward), trainer, amp)


def _make_forward(lm, trl_forward, options, trainer, amp=None):
    """Our forward for `lm`, as a method bound to it (module docstring). `trl_forward` is the
    forward TRL's calls go to (TRL's, or accelerate's wrapper around it); `amp()`, when given,
    the autocast context accelerate's wrapper enters, entered around our fused path."""
    owner = weakref.ref(trainer)
    orphan_reasons: set[str] = set()

    def falls_back(reason: str | None) -> bool:
        tr = owner()
        if tr is not None:
            return tr._lce_falls_back(reason)
        if reason is not None and reason not in orphan_reasons:  # the trainer is gone
            orphan_reasons.add(reason)
            logger.warning("grpo_lce head not used (%s); using TRL's own fused head.", reason)
        return reason is not None

    # `generate` checks its keyword arguments against the forward's signature: keep the model's
    # own, as TRL does
    @functools.wraps(type(lm).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, **kwargs):
        extra = dict(labels=labels, shift_labels=shift_labels,
                     num_items_in_batch=num_items_in_batch)
        if not fused_lm_head:
            return trl_forward(*args, **extra, **kwargs)
        if falls_back(_fallback_reason(self, labels, shift_labels, kwargs)):
            return trl_forward(*args, fused_lm_head=True, **extra, **kwargs)
        tr = owner()
        pack = None
        if tr is not None and hasattr(tr, "_lce_packing_kind"):
            kind = tr._lce_packing_kind(self, args, kwargs)
            if kind is not None:
                pack = (kind, tr.max_packed_tokens, tr._lce_pack_if_shorter, tr._lce_packing_note)
        with contextlib.nullcontext() if amp is None else amp():
            return fused_outputs(self, args, kwargs, labels=labels, shift_labels=shift_labels,
                                 num_items_in_batch=num_items_in_batch, pack=pack, **options)

    forward.grpo_lce_fused = True
    forward.trl_forward = trl_forward
    return types.MethodType(forward, lm)


def _fallback_reason(lm, labels, shift_labels, kwargs) -> str | None:
    """Why this call goes to TRL's forward, or None (module docstring)."""
    if labels is None and shift_labels is None:
        return "fused_lm_head=True without labels"
    present = sorted(k for k in _MULTIMODAL_INPUTS if kwargs.get(k) is not None)
    if present:
        return f"multimodal inputs ({', '.join(present)})"
    text_config = lm.config.get_text_config()
    if kwargs.get("output_router_logits") or getattr(text_config, "output_router_logits", False):
        return "MoE router logits requested (TRL computes the load-balancing aux loss)"
    return fused_head_unsupported_reason(lm)


def fused_outputs(lm, args, kwargs, *, labels, shift_labels, num_items_in_batch, temperature,
                  outputs, pack=None) -> FusedCausalLMOutput:
    """TRL's `FusedCausalLMOutput` for `lm(*args, **kwargs, labels=..., fused_lm_head=True)`,
    computed by grpo_lce (module docstring). `pack`: (kind, max tokens or None, `if_shorter`
    (`trainers.packing.plan_target_packs`), a function logging a note once) to try the packed
    backbone pass, or None."""
    kwargs["use_cache"] = False
    weight, bias = lm_head_params(lm)
    if shift_labels is None:
        # h_t scores token t+1; the last position scores nothing
        y = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    else:
        y = shift_labels
    y = y.to(weight.device)  # (B, L)
    head = dict(temperature=temperature, outputs=outputs)
    fields = None if pack is None else packed_fields(lm, kwargs, y, weight, bias, pack, **head)
    if fields is None:
        hidden = lm.base_model(*args, **kwargs).last_hidden_state  # (B, L, H)
        fields = score_rows(hidden, weight, bias, y, **head)
    if shift_labels is None:
        fields = {k: None if v is None else v[:, :-1].contiguous() for k, v in fields.items()}
    mask = fields["label_mask"]
    divisor = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / divisor, **fields)


def packed_fields(lm, kwargs, y, weight, bias, pack, *, temperature: float, outputs
                  ) -> dict | None:
    """The per-token fields (B, L) from packed backbone passes over the valid tokens (module
    docstring, "Packing"), or None for the padded pass (a mask or labels that do not pack, or
    nothing to score)."""
    kind, max_tokens, if_shorter, note = pack
    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    plan = plan_target_packs(ids, mask, y, max_tokens=max_tokens or ids.numel(),
                             if_shorter=if_shorter)
    if plan is None:
        note(_UNPACKABLE)
        return None
    if not plan.packs:
        # nothing scored (the padded pass gives the zeros and their graph), or nothing to remove
        return None

    def forward(inputs):  # the backbone on one pack, as the padded pass calls it
        return lm.base_model(**inputs, use_cache=False).last_hidden_state  # (1, T, H)

    hidden = packed_hidden(plan, kind, forward)  # (N, H), N scored tokens
    fields = score_rows(hidden, weight, bias, plan.targets.to(weight.device),
                        temperature=temperature, outputs=outputs)
    fields = {k: None if v is None else unpack(v, plan) for k, v in fields.items()}
    fields["label_mask"] = y != -100
    return fields


def score_rows(hidden, weight, bias, y, *, temperature: float, outputs) -> dict:
    """The per-token fields of `FusedCausalLMOutput` (each shaped like y, 0 / False where y is
    −100) for hidden states `hidden` (..., H) whose row t is scored against y_t."""
    want_entropy, want_top1 = "entropy" in outputs, "is_top1" in outputs
    res = head_logprobs(hidden, weight, bias, y, temperature=temperature,
                        return_entropy=want_entropy, return_argmax=want_top1)
    res = list(res) if isinstance(res, tuple) else [res]
    mask = y != -100
    fields = {
        "log_probs": res.pop(0),
        "entropy": res.pop(0) if want_entropy else None,
        # argmax is −1 at the ignored rows, never a label
        "is_top1": res.pop(0) == y if want_top1 else None,
        "mean_logits": None,
        "log_sum_sq_probs": None,
        "label_mask": mask,
    }
    with torch.no_grad():
        if "mean_logits" in outputs:
            fields["mean_logits"] = mean_logits(hidden, weight, bias, temperature) * mask
        if "log_sum_sq_probs" in outputs:
            fields["log_sum_sq_probs"] = log_sum_sq_probs(hidden, weight, bias, mask,
                                                          temperature)
    return fields


def mean_logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """mean_v z = (h · w̄ + b̄) / τ in fp32, shaped like hidden's rows; w̄ = Σ_v W_v / V.

    h is upcast a slab of rows at a time (no fp32 copy of all of it); the V-term sum over W is
    an fp32 reduction of the weight as stored (no fp32 copy of W)."""
    V, H = weight.shape
    w_mean = weight.detach().sum(0, dtype=torch.float32) / V  # (H,)
    b_mean = 0.0 if bias is None else bias.detach().sum(dtype=torch.float32) / V
    rows = hidden.detach().reshape(-1, H).to(weight.device)
    step = max(1, _MEAN_ROWS_BYTES // (4 * H))
    out = torch.cat([rows[s:s + step].float() @ w_mean for s in range(0, rows.shape[0], step)])
    return ((out + b_mean) / temperature).view(hidden.shape[:-1])


def log_sum_sq_probs(hidden, weight, bias, mask, temperature: float) -> torch.Tensor:
    """log Σ_v p_v² (fp32, no gradient) at the rows where `mask`, 0 elsewhere.

    With d = z − max_v z: Σ p² = Σ e^{2d} / (Σ e^d)², so log Σ p² = lse(2d) − 2 lse(d), both
    relative to the row maximum (no cancellation of two lse-sized numbers). A second pass over
    the labelled rows' logits, chunk by chunk (`grpo_lce.chunked_linear`)."""
    V, H = weight.shape
    rows = hidden.detach().reshape(-1, H)[mask.reshape(-1).to(hidden.device)]  # (n, H)
    rows = rows.to(device=weight.device, dtype=weight.dtype)
    b = None if bias is None else bias.detach().float()
    inv_tau = 1.0 / temperature

    def fn(xw):  # (C, V) fp32 = h Wᵀ
        z = (xw if b is None else xw + b) * inv_tau
        d = z - z.amax(-1, keepdim=True)
        return torch.logsumexp(2 * d, -1) - 2 * torch.logsumexp(d, -1)  # (C,)

    # fn holds about four (C, V) fp32 temporaries: size the chunk for them
    chunk = default_chunk_size(V, n_operands=4, operand_bytes=4, n_rows=rows.shape[0])
    with torch.autocast(weight.device.type, enabled=False):
        vals = chunked_linear(fn, rows, weight.detach(), chunk_size=chunk)
    out = torch.zeros(mask.shape, device=weight.device, dtype=torch.float32)
    return out.masked_scatter(mask.to(weight.device), vals)
