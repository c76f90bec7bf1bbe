"""Packing's attention policy, in one place: which attention a packed forward runs with, decided
once per model, and the sdpa attention implementation it may switch a model to.

Where packing is decided: `choose_packing(model, packing)` is the rule; `PackingDecisions` keeps
its answer per model until something it reads changes, one instance per trainer
(`trainers.base.FusedHeadMixin._lce_packing_for`). The trainers add only their per-call vetoes;
sampling calls `FusedHeadMixin._lce_settle_attention` first, since the decision may switch the
attention implementation a compiled decode step captures. The mechanism (plans, packed
forwards, unpacking) is `trainers.packing`.

Kinds, from the mask function transformers registered for `config._attn_implementation`:

    "varlen"       flash_attention_2/3/4 and hub flash kernels: no mask, `cu_seq_lens_q/k`
    "block"        flex_attention: a BlockMask, fully masked blocks between rows skipped
    "sdpa_varlen"  `IMPL` (below): sdpa, with PyTorch's varlen FlashAttention for packed calls
    "dense"        eager / sdpa where varlen_attn cannot run: a dense (T, T) mask, exact but
                   T² work, so "auto" stays padded (True packs, with a note)

To add a kind: this file only — `attention_packing_kind` names it, `VARLEN_KINDS` says whether
its calls take the row boundaries, `pack_context` what a packed call runs inside.

`IMPL` ("sdpa_varlen"): `use_sdpa_varlen(model)` registers it with transformers (importing this
module registers nothing) and switches the model to it. Attention: varlen_attn over
`cu_seq_lens_q/k` when a call carries them (only packed forwards do), else transformers'
`sdpa_attention_forward`; mask: None inside `packed_forward()`, else `sdpa_mask`. So every
unpacked call (padded passes, `generate`) is sdpa bit for bit. Where varlen_attn cannot run
(no CUDA, fp32, an older torch) a packed call gets the equivalent block-diagonal causal mask:
exact, at the dense cost (how the CPU tests check it); `varlen_blocker` keeps "auto" from
choosing `IMPL` there. Sliding windows, softcapping, attention dropout and sinks are refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
)
from transformers.utils import logging

from .models import PeftModel, unwrap_causal_lm, unwrap_model

logger = logging.get_logger(__name__)

IMPL = "grpo_lce_sdpa_varlen"
# The kinds whose packed calls carry the row boundaries `cu_seq_lens_q/k`, `max_length_q/k`.
VARLEN_KINDS = ("varlen", "sdpa_varlen")
# Layer kinds that only attend: packing relies on attention being the one place where tokens
# of different rows meet. Recurrent or convolutional layers (Mamba, linear attention) carry
# state across the row boundary, so models with them are never packed.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}

_HALF = (torch.float16, torch.bfloat16)
# Attention-function kwargs that change the attention pattern or scores; the varlen call below
# implements plain causal softmax attention only.
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")

_packed = contextvars.ContextVar("grpo_lce_packed_forward", default=False)


# --------------------------------------------------------------------------- the decision


def attention_packing_kind(model: torch.nn.Module) -> str | None:
    """"varlen", "block", "sdpa_varlen", "dense" (module docstring) or None (an implementation
    without transformers' packed-sequence handling: packed rows would see each other). As the
    model is now; `choose_packing` may switch sdpa to `IMPL`."""
    impl = unwrap_causal_lm(model).config._attn_implementation
    # Hub kernels register the mask function of the implementation they stand in for, so the
    # mask function, not the name, says how a packed sequence will be masked.
    if impl is None or impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[impl]
    if mask_fn is flash_attention_mask:
        return "varlen"
    if mask_fn is flex_attention_mask:
        return "block"
    if impl == IMPL:
        return "sdpa_varlen"
    if mask_fn in (sdpa_mask, eager_mask):
        return "dense"
    return None


def pack_context(kind: str) -> contextlib.AbstractContextManager:
    """What one packed model call of this kind runs inside."""
    return packed_forward() if kind == "sdpa_varlen" else contextlib.nullcontext()


def packing_blocker(model: torch.nn.Module) -> str | None:
    """Why packing would not be exact for `model` whatever the option says, or None."""
    peft = unwrap_model(model)
    if PeftModel and isinstance(peft, PeftModel) and peft.active_peft_config.is_prompt_learning:
        return "a prompt-learning PEFT adapter (virtual tokens or a prefix cache per row)"
    config = unwrap_causal_lm(model).config
    impl = config._attn_implementation
    if config.get_text_config() is not config:
        return f"a composite model ({type(config).__name__}): packing is checked for text LMs only"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - _ATTENTION_LAYER_TYPES:
        kinds = sorted(layer_types - _ATTENTION_LAYER_TYPES)
        return f"non-attention layers ({', '.join(kinds)}) would carry state across packed rows"
    if attention_packing_kind(model) is None:
        return f"attn_implementation={impl!r} has no packed-sequence masking in transformers"
    return None


def choose_packing(model: torch.nn.Module, packing: bool | str) -> tuple[str | None, str | None]:
    """(kind to pack with, or None for padded forwards; a note to log once, or None) for the
    trainer option `packing` in {"auto", True, False}: "auto" packs the kinds "varlen", "block"
    and "sdpa_varlen", True also "dense". Switches an sdpa model to `IMPL` where varlen_attn
    runs (the one side effect)."""
    if packing is False:
        return None, None
    reason = packing_blocker(model)
    kind = attention_packing_kind(model) if reason is None else None
    lm = unwrap_causal_lm(model)
    impl = lm.config._attn_implementation
    no_varlen = varlen_blocker(lm) if kind == "dense" else None
    if kind == "dense" and no_varlen is None:
        use_sdpa_varlen(lm)  # sdpa for every unpacked call, varlen for packed ones
        kind = "sdpa_varlen"
    if kind == "dense" and packing == "auto":
        return None, _padded_note(lm, impl, no_varlen)
    if reason is not None:
        return None, f"grpo_lce packing off ({reason}); using padded forwards."
    if kind == "dense":
        return kind, (
            f"grpo_lce packing forced under attn_implementation={impl!r}: transformers builds a "
            "dense (T, T) mask for the packed sequence (exact, but not leaner than padding)."
        )
    return kind, None


def _padded_note(lm: torch.nn.Module, impl: str, why: str) -> str:
    """One line for `packing="auto"` under a dense-mask implementation: log-probs stay padded,
    and what would pack on this device. On CPU nothing would: flex_attention fails in backward
    there (in stock TRL too) and a dense mask is no leaner than padding."""
    param = _first_float(lm)
    if param is None or not param.is_cuda:
        return f"grpo_lce: log-prob passes stay padded ({impl} on CPU has no packed kernel)."
    if param.dtype not in _HALF:
        hint = "train in bf16 or fp16 to pack"
    else:
        hint = "attn_implementation='flash_attention_2' or 'flex_attention' would pack"
    return f"grpo_lce: log-prob passes stay padded ({why}; {hint})."


def _first_float(lm: torch.nn.Module) -> torch.Tensor | None:
    return next((p for p in lm.parameters() if p.is_floating_point()), None)


class PackingDecisions:
    """`choose_packing`'s answer per model, computed again only when something it reads has
    changed: the option, the attention implementation, a prompt-learning adapter in front, the
    dtype and device of the first floating parameter (`varlen_blocker`'s and `_padded_note`'s
    inputs; the config's layer types, windows and softcaps are fixed per model). Keyed weakly by
    the causal LM, so a freed model leaves nothing behind."""

    def __init__(self):
        self._by_lm: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def decide(self, model: torch.nn.Module, packing: bool | str
               ) -> tuple[str | None, str | None]:
        """`choose_packing(model, packing)`, from the cache when nothing it reads changed."""
        lm = unwrap_causal_lm(model)
        hit = self._by_lm.get(lm)
        if hit is None or hit[0] != _state(model, lm, packing):
            decision = choose_packing(model, packing)
            # keyed by the state it left: a switch to IMPL is part of the decision
            hit = self._by_lm[lm] = (_state(model, lm, packing), decision)
        return hit[1]


def _state(model: torch.nn.Module, lm: torch.nn.Module, packing: bool | str) -> tuple:
    peft = unwrap_model(model)
    prompt = bool(PeftModel and isinstance(peft, PeftModel)
                  and peft.active_peft_config.is_prompt_learning)
    param = _first_float(lm)
    where = None if param is None else (param.dtype, param.device)
    return packing, lm.config._attn_implementation, prompt, where


# --------------------------------------------------------------------------- IMPL: sdpa + varlen


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """While active, `IMPL`'s mask function returns None: the model call inside is one packed
    sequence whose rows the attention keeps apart through `cu_seq_lens_q/k`."""
    token = _packed.set(True)
    try:
        yield
    finally:
        _packed.reset(token)


@functools.cache
def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn and the keywords this torch's version takes."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_kernel_available() -> bool:
    """Whether this torch has varlen_attn with a way to ask for causal attention."""
    fn, params = _varlen_attn()
    return fn is not None and bool({"window_size", "is_causal"} & params)


def _kernel_runs(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in _HALF and varlen_kernel_available()


def _sdpa_varlen_mask(*args, **kwargs):
    if _packed.get():
        return None
    return sdpa_mask(*args, **kwargs)


def _block_causal_mask(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """(1, 1, T, T) bool: query t sees key s iff both lie in the same row and s <= t."""
    row = torch.bucketize(torch.arange(T, device=device), cu_seqlens[1:].to(device), right=True)
    pos = torch.arange(T, device=device)
    mask = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None])
    return mask[None, None]


# Whether this process's varlen_attn took K and V with fewer heads than Q without an
# `enable_gqa` keyword (FlashAttention reads kv head h // G for query head h itself); False
# after it refused them once: K and V are then expanded to Q's heads.
_native_gqa = [True]


def _varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling):
    """query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D) via varlen_attn.

    Grouped-query attention (Hkv < Hq) passes K and V with their own heads: through
    `enable_gqa` where varlen_attn has it, else as they are (FlashAttention's varlen kernels
    take Hkv dividing Hq, forward and backward). Expanding them to Hq heads instead would hold
    two (T, Hq, D) copies per layer in the training pass, which its backward's recompute keeps
    live at the memory peak; that expansion is the fallback where a kernel refuses them."""
    fn, params = _varlen_attn()
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, H, D)
    kw = {"scale": scaling}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal: every key up to the query, none after
    else:
        kw["is_causal"] = True
    args = (cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif _native_gqa[0]:
            try:
                return fn(q, k, v, *args, **kw).unsqueeze(0)
            except (RuntimeError, ValueError) as exc:
                _native_gqa[0] = False
                logger.warning(f"grpo_lce packing: varlen_attn refused K and V with "
                               f"{k.shape[1]} heads for {q.shape[1]} query heads "
                               f"({str(exc).splitlines()[0][:160]}); they are expanded to "
                               "the query heads from now on")
        if not kw.get("enable_gqa"):
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return fn(q, k, v, *args, **kw).unsqueeze(0)


def sdpa_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          **kwargs):
    """transformers attention function of `IMPL` (module docstring). Returns (out (B, T, Hq, D),
    None) like sdpa_attention_forward."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    unsupported = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if unsupported or dropout:
        raise NotImplementedError(
            f"{IMPL}: a packed forward with {unsupported or ['attention dropout']} is not "
            "supported; use packing=False for this model")
    if query.shape[0] != 1:
        raise ValueError(f"{IMPL}: a packed forward has batch size 1, got {query.shape[0]}")
    cu_k = kwargs.get("cu_seq_lens_k", cu_q)
    T = query.shape[2]
    if _kernel_runs(query):
        out = _varlen(query, key, value, cu_q, cu_k, kwargs.get("max_length_q", T),
                      kwargs.get("max_length_k", T), scaling)
        return out, None
    # Exact fallback: the same rows kept apart by a dense block-diagonal causal mask.
    mask = _block_causal_mask(cu_q, T, query.device)
    rest = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=False, **rest)


def varlen_blocker(model: torch.nn.Module) -> str | None:
    """Why `model` (a transformers causal LM, unwrapped) should not switch to `IMPL`, or None."""
    config = model.config
    if config._attn_implementation not in ("sdpa", IMPL):
        return f"attn_implementation={config._attn_implementation!r} is not sdpa"
    if not varlen_kernel_available():
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    param = _first_float(model)
    if param is None or not param.is_cuda or param.dtype not in _HALF:
        where = "no floating parameter" if param is None else f"{param.dtype} on {param.device}"
        return f"varlen FlashAttention runs fp16/bf16 on CUDA ({where})"
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in set(
        getattr(config, "layer_types", None) or ()
    ):
        return "sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention-logit softcapping"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def register() -> None:
    """Make `IMPL` known to transformers: its attention function and its mask function, in the
    process-wide tables `set_attn_implementation` and the mask builders read. Idempotent."""
    AttentionInterface.register(IMPL, sdpa_varlen_attention)
    AttentionMaskInterface.register(IMPL, _sdpa_varlen_mask)


def use_sdpa_varlen(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers causal LM, unwrapped) from sdpa to `IMPL`, registering it
    first: identical for every unpacked call, varlen FlashAttention for packed ones (module
    docstring). transformers refuses an implementation it does not know, so every model under
    `IMPL` got there through this call, the one place that registers."""
    register()
    if model.config._attn_implementation != IMPL:
        model.set_attn_implementation(IMPL)
