"""Packed forwards for sdpa models, through PyTorch's own variable-length FlashAttention.

Under attn_implementation="sdpa", transformers keeps the rows of a packed sequence apart only
with a dense (1, 1, T, T) mask: T² mask bytes and T² attention work, more than the padded
B·L² it replaces, so `packing="auto"` would stay padded there. FlashAttention's varlen kernel
needs no mask at all, only the row boundaries `cu_seqlens`, and PyTorch ships it
(`torch.nn.attention.varlen.varlen_attn`, the FlashAttention SDPA itself dispatches to): a
model loaded with the default sdpa attention packs without flash-attn installed.

How. `use_sdpa_varlen(model)` switches the model to the attention implementation `IMPL`,
which it registers with transformers first (importing this module registers nothing: the
process-wide attention tables change only once a model is switched) as

    attention   varlen_attn over `cu_seq_lens_q/k` when a call carries them (only our packed
                forwards pass them: `trainers.packing.Pack.model_inputs`), else transformers'
                own `sdpa_attention_forward` with the same arguments;
    mask        None inside `packed_forward()` (the varlen kernel needs none, and the dense
                mask is the cost avoided), else transformers' own `sdpa_mask`.

So every call that is not one of our packed forwards (padded log-prob passes, `generate`) is
sdpa, bit for bit. The mask is built once per model call, before the decoder layers, so
gradient checkpointing's recompute reuses it and the same kwargs, and so the same kernel.

When varlen_attn cannot run a call (no CUDA, fp32 inputs, a torch without it), the packed call
still goes through sdpa with the equivalent block-diagonal causal mask built from cu_seqlens:
exact, at the dense cost. That is how the CPU tests check the dispatch; `varlen_blocker` keeps
`packing="auto"` from choosing this implementation where the kernel would not run.

Not supported (packing stays padded): sliding-window layers, attention-logit softcapping,
attention dropout, attention sinks. The attention function refuses such a packed call outright
rather than silently dropping the feature.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPL = "grpo_lce_sdpa_varlen"

_HALF = (torch.float16, torch.bfloat16)
# Attention-function kwargs that change the attention pattern or scores; the varlen call below
# implements plain causal softmax attention only.
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")

_packed = contextvars.ContextVar("grpo_lce_packed_forward", default=False)


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


def _varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling):
    """query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D) via varlen_attn."""
    fn, params = _varlen_attn()
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, H, D)
    kw = {"scale": scaling}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal: every key up to the query, none after
    else:
        kw["is_causal"] = True
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = fn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), **kw)
    return out.unsqueeze(0)


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
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
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
