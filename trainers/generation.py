"""Fast on-policy sampling: TRL's `generate` call over a static KV cache and a compiled decode step.

TRL's non-vLLM path samples with `model.generate` and a dynamic cache. Each decode step then
launches every kernel of the forward from Python, one token at a time: at batch 8 a 1B NF4 + LoRA
model spends most of a step launching small kernels, and a GRPO step is almost all generation.

`FastSampler.generate` makes the same `model.generate` call, so the logits processors
(temperature, top-k, top-p, min-p, repetition penalty, `generation_kwargs`), the stopping criteria
and the EOS / padding handling are transformers' own, as in stock TRL. Two things differ:

- the KV cache is a `StaticCache` owned by the sampler: allocated once per batch size and mode
  (grown for a longer prompt, below), reset in place between calls, so the decode step always
  sees the same shapes and the same cache addresses;
- the decode step runs transformers' compiled forward (`CompileConfig`: torch.compile, inductor,
  CUDA graphs through mode "reduce-overhead"); the prefill stays eager.

Cache length: M = C + N for N = max_new_tokens and a prompt capacity C, first the batch's
left-padded prompt length P rounded up to a multiple of 16. A batch with a shorter prompt reuses
the cache (its attention mask hides the unused positions); a longer one grows C to
max(P, 1.5 C), rounded up again, at most `MAX_GROWTHS` times, after which a prompt that does not
fit is sampled by TRL's path. So a run compiles at most 1 + MAX_GROWTHS times per batch size and
train/eval mode, each compile counted and timed, and the cache holds at most 15 positions more
than the longest prompt plus N until it first grows. The cache stays allocated between calls
(a captured decode step reads it at fixed addresses): B (C + N) tokens of keys and values.

Current weights: the compiled graph reads every parameter from its storage (parameters are graph
inputs, never constants: inductor's `freezing` is off) and optimizers update parameters in place,
so a replay after an optimizer step samples from the updated policy.
(`tests/test_generation.py` checks this with an optimizer step that changes a greedy completion.)

Safety: the first call with each new cache is a warm-up that compiles and captures the step, then
compares the compiled decode logits of its first steps with an eager `generate` of the same
prompts. Any exception in compiling or capturing, a mismatch beyond bf16 noise, or recompiles
on calls that should replay, turn the sampler off for the rest of the run with one logged line;
the caller then samples with TRL's eager path.

bitsandbytes 4-bit layers: transformers marks every quantizer "not compileable" unless it says
otherwise, and bitsandbytes' 4-bit quantizer does not say. Its kernels are registered torch custom
ops, which dynamo treats as opaque calls; the sampler lets the compile check pass for this
quantizer only, for the duration of its own `generate` call (an instance attribute of that
model, restored afterwards).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

PROMPT_ROUND = 16  # prompt capacities are multiples of this
GROWTH = 1.5  # a cache that must grow makes room for at least this many times more prompt
MAX_GROWTHS = 3  # per batch size and mode; later prompts that do not fit go to TRL's path
WARMUP_NEW_TOKENS = 3  # prefill + 2 compiled decode steps: compile, CUDA-graph warm-up, capture
# Tolerance of the warm-up check, mean |compiled - eager| <= TOL * mean |eager| over the logits of
# the rows whose tokens so far agree: fused bf16 kernels round differently from eager ones, which
# through a deep bf16 stack moves the logits by a few per cent of their size (the largest single
# differences more); a broken cache, mask, position or input moves them by their own size.
WARMUP_LOGITS_RTOL = 0.1
MAX_RECOMPILING_CALLS = 2  # calls that compile although their cache was warmed up


@dataclasses.dataclass
class SamplerStats:
    """What the sampler has done in this run; logged and reported as metrics."""

    calls: int = 0  # generate calls served by the compiled path
    compiles: int = 0  # warm-ups, one per new cache (batch size, train/eval mode, length)
    graphs: int = 0  # dynamo graphs compiled in all (a graph break adds one)
    compile_s: float = 0.0  # wall time of the warm-ups: compile, capture, the eager check
    recompiling_calls: int = 0


def prompt_capacity(prompt_len: int, previous: int = 0) -> int:
    """The prompt room of a new cache: `prompt_len`, or 1.5x the `previous` room if that is more,
    rounded up to a multiple of PROMPT_ROUND."""
    want = max(prompt_len, math.ceil(GROWTH * previous))
    return -(-want // PROMPT_ROUND) * PROMPT_ROUND


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _base_model(model):
    """The transformers model whose `generate` runs the decode loop (a PEFT model's base)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class _CompileableQuantizer:
    """A view of an `HfQuantizer` that reports `is_compileable = True`; everything else is
    read from the quantizer itself."""

    is_compileable = True

    def __init__(self, quantizer):
        self._quantizer = quantizer

    def __getattr__(self, name):
        return getattr(self._quantizer, name)


def _is_bnb_4bit(quantizer) -> bool:
    config = getattr(quantizer, "quantization_config", None)
    method = getattr(config, "quant_method", "")
    return (type(quantizer).__name__ == "Bnb4BitHfQuantizer"
            or bool(getattr(config, "load_in_4bit", False)
                    and getattr(method, "value", method) == "bitsandbytes"))


@contextlib.contextmanager
def _compile_allowed(base):
    """Let transformers' compile check pass for a bitsandbytes 4-bit model during one call."""
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is None or quantizer.is_compileable or not _is_bnb_4bit(quantizer):
        yield
        return
    base.hf_quantizer = _CompileableQuantizer(quantizer)
    try:
        yield
    finally:
        base.hf_quantizer = quantizer


def completion_lengths(completions: torch.Tensor, eos_token_ids) -> list[int]:
    """Per row of `completions` (B, S): its tokens up to and including its first EOS (S when it
    has none)."""
    completions = completions.cpu()
    is_eos = torch.isin(completions, torch.as_tensor(eos_token_ids, dtype=completions.dtype))
    return torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.size(1)).tolist()


def trim_after_eos(completions: torch.Tensor, eos_token_ids) -> list[list[int]]:
    """Each row of `completions` (B, S) up to and including its first EOS, as token lists: what
    TRL's generate path keeps of a padded batch of completions."""
    ends = completion_lengths(completions, eos_token_ids)
    return [row[:n].tolist() for row, n in zip(completions.cpu(), ends)]


@contextlib.contextmanager
def _input_grad_hooks_set_aside(base):
    """Remove transformers' `make_inputs_require_grads` hooks from the input embeddings for the
    duration of one call.

    `gradient_checkpointing_enable` registers one more of these hooks each time it runs, and
    TRL turns checkpointing off and on around every generation, so their number grows by step;
    dynamo guards on it and would recompile the decode step at every call. The hooks only mark
    the embedding output as requiring grad for a backward; generation runs under no_grad, where
    they change nothing.
    """
    get_embeddings = getattr(base, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    hooks = getattr(embeddings, "_forward_hooks", None)
    if not hooks:
        yield
        return
    removed = {k: h for k, h in hooks.items()
               if getattr(h, "__name__", "") == "make_inputs_require_grads"}
    for k in removed:
        del hooks[k]
    try:
        yield
    finally:
        hooks.update(removed)


def _share_active_adapter_objects(base) -> None:
    """Make PEFT layers whose active-adapter values are equal hold one and the same object.

    PEFT's `set_adapter` stores a fresh `[name]` list in every layer, and TRL switches adapters
    around each reference pass (disabling the adapter re-enables it through `set_adapter`).
    Dynamo guards on whether two layers hold the same object, so after the first reference
    pass the decode step would compile again. Equal values, one object: PEFT only ever assigns
    this attribute, never mutates it in place, so sharing it changes nothing else.
    """
    shared: list = []
    for module in base.modules():
        value = module.__dict__.get("_active_adapter")
        if value is None:
            continue
        same = next((v for v in shared if v == value), None)
        if same is None:
            shared.append(value)
        elif same is not value:
            module._active_adapter = same


def unsupported_reason(model, generation_config, devices=("cuda",)) -> str | None:
    """Why the compiled path cannot serve `model` with `generation_config`, or None."""
    if model.device.type not in devices:
        return f"it needs a {' or '.join(d.upper() for d in devices)} device"
    try:
        from transformers import StaticCache  # noqa: F401
        from transformers.generation.configuration_utils import CompileConfig  # noqa: F401
    except ImportError:
        return "this transformers has no StaticCache / CompileConfig"
    base = _base_model(model)
    if not getattr(base, "_can_compile_fullgraph", False):
        return f"{type(base).__name__} does not support a static cache"
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable and not _is_bnb_4bit(quantizer):
        return f"the {type(quantizer).__name__} quantizer does not support torch.compile"
    mode = generation_config.get_generation_mode()
    mode = getattr(mode, "value", str(mode))
    if mode not in ("sample", "greedy_search"):
        return f"generation mode {mode!r} (only sampling and greedy decoding are compiled)"
    if generation_config.cache_implementation not in (None, "static", "dynamic"):
        return f"cache_implementation={generation_config.cache_implementation!r}"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size is set"
    return None


@dataclasses.dataclass
class _CacheEntry:
    cache: object  # transformers.StaticCache of capacity + new_tokens positions
    capacity: int  # prompt tokens it holds
    new_tokens: int
    growths: int
    warm: bool = False  # compiled (or an earlier graph reused), captured and checked
    full_logged: bool = False  # said once that a prompt did not fit after the last growth


class FastSampler:
    """Samples with `model.generate` over a reused static cache and a compiled decode step.

    `generate(model, input_ids, attention_mask, generation_config)` returns what
    `model.generate(input_ids=..., attention_mask=..., generation_config=...)` returns (the
    prompt followed by the completions), or None when the compiled path is off or has just
    turned itself off; the caller then samples its own way. `disabled_reason` says why.
    """

    def __init__(self, compile_config=None, devices=("cuda",)):
        self.compile_config = compile_config
        # Where the compiled path runs. Tests add "cpu" with a CPU compile config
        # (`CompileConfig._compile_all_devices`) to exercise it without a GPU.
        self.devices = tuple(devices)
        self.disabled_reason: str | None = None
        self.stats = SamplerStats()
        self._caches: dict[tuple, _CacheEntry] = {}  # (batch, training) -> its static cache

    def _config(self):
        if self.compile_config is None:
            from transformers.generation.configuration_utils import CompileConfig

            # dynamic=False: one static-shape graph per cache shape, never a dynamic-shape
            # recompile; fullgraph=False: a graph break costs speed, not the call.
            self.compile_config = CompileConfig(fullgraph=False, dynamic=False,
                                                backend="inductor", mode="reduce-overhead")
        return self.compile_config

    def disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.warning(f"grpo_lce fast generation off ({reason}); sampling with TRL's "
                           "eager generate for the rest of the run.")
        self._caches.clear()

    def _cache_for(self, model, batch: int, prompt_len: int, new_tokens: int):
        """The cache entry for this batch size and mode, allocated or grown as the module
        docstring says; None when the prompt does not fit and the cache may not grow again."""
        from transformers import StaticCache

        key = (batch, model.training)
        entry = self._caches.get(key)
        if entry is not None and prompt_len <= entry.capacity and new_tokens == entry.new_tokens:
            return entry
        growths = 0 if entry is None else entry.growths + 1
        if growths > MAX_GROWTHS:
            if not entry.full_logged:
                entry.full_logged = True
                logger.warning(
                    f"grpo_lce fast generation: a {prompt_len}-token prompt does not fit the "
                    f"compiled cache ({entry.capacity} prompt tokens, grown {MAX_GROWTHS} times); "
                    "such batches sample with TRL's generate.")
            return None
        capacity = prompt_capacity(prompt_len, 0 if entry is None else entry.capacity)
        self._caches.pop(key, None)  # the old cache goes before the new one is allocated
        cache = StaticCache(config=_base_model(model).config, max_cache_len=capacity + new_tokens)
        entry = self._caches[key] = _CacheEntry(cache, capacity, new_tokens, growths)
        return entry

    def _generate(self, model, input_ids, attention_mask, config, cache):
        cache.reset()
        base = _base_model(model)
        _share_active_adapter_objects(base)
        with _compile_allowed(base), _input_grad_hooks_set_aside(base):
            return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                  generation_config=config, past_key_values=cache)

    def _warm_up(self, model, input_ids, attention_mask, config, cache) -> str | None:
        """Compile and capture the decode step over this cache; None, or why it failed the
        check against eager decoding."""
        warm = copy.deepcopy(config)
        warm.max_new_tokens, warm.min_new_tokens = WARMUP_NEW_TOKENS, None
        warm.do_sample = False
        warm.output_logits, warm.return_dict_in_generate = True, True
        for _ in range(2):  # dynamo compiles on the first decode call, CUDA graphs record later
            compiled = self._generate(model, input_ids, attention_mask, warm, cache)
        eager_cfg = copy.deepcopy(warm)
        eager_cfg.disable_compile, eager_cfg.compile_config = True, None
        eager = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                               generation_config=eager_cfg)
        P = input_ids.shape[1]
        same_prefix = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step, (lc, le) in enumerate(zip(compiled.logits, eager.logits)):
            if step > 0:  # compare rows whose tokens so far agree
                prev = P + step - 1
                same_prefix &= compiled.sequences[:, prev] == eager.sequences[:, prev]
            if not same_prefix.any():
                break
            lc, le = lc[same_prefix].float(), le[same_prefix].float()
            if not torch.isfinite(lc).all():
                return f"non-finite compiled logits at decode step {step}"
            err = (lc - le).abs().mean().item()
            scale = le.abs().mean().item()
            if err > WARMUP_LOGITS_RTOL * scale:
                return (f"compiled logits differ from eager ones at decode step {step}: "
                        f"mean |diff| {err:.3g} against mean |logit| {scale:.3g}")
        return None

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask, generation_config):
        if self.disabled_reason is not None:
            return None
        reason = unsupported_reason(model, generation_config, self.devices)
        if reason is not None:
            self.disable(reason)
            return None
        batch, prompt_len = input_ids.shape
        new_tokens = generation_config.max_new_tokens
        if new_tokens is None:
            new_tokens = generation_config.max_length - prompt_len
        config = copy.deepcopy(generation_config)
        config.cache_implementation = None  # the cache is passed in
        config.disable_compile, config.compile_config = False, self._config()
        try:
            entry = self._cache_for(model, batch, prompt_len, new_tokens)
            if entry is None:
                return None
            cache, length = entry.cache, entry.capacity + entry.new_tokens
            graphs = _dynamo_graphs()
            if not entry.warm:
                t0 = time.perf_counter()
                mismatch = self._warm_up(model, input_ids, attention_mask, config, cache)
                if input_ids.is_cuda:
                    torch.cuda.synchronize()
                self.stats.compile_s += time.perf_counter() - t0
                self.stats.compiles += 1
                self.stats.graphs += _dynamo_graphs() - graphs
                if mismatch is not None:
                    self.disable(mismatch)
                    return None
                entry.warm = True
                logger.warning(
                    f"grpo_lce fast generation: decode step compiled for batch {batch}, cache "
                    f"{length} tokens ({'train' if model.training else 'eval'} mode) in "
                    f"{self.stats.compile_s:.1f} s so far ({self.stats.compiles} compile(s)).")
                graphs = _dynamo_graphs()
            out = self._generate(model, input_ids, attention_mask, config, cache)
        except Exception as exc:  # noqa: BLE001 - any failure here falls back, with its reason
            self.disable(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return None
        new_graphs = _dynamo_graphs() - graphs
        if new_graphs:
            self.stats.graphs += new_graphs
            self.stats.recompiling_calls += 1
            if self.stats.recompiling_calls >= MAX_RECOMPILING_CALLS:
                self.disable(f"the decode step recompiled on {self.stats.recompiling_calls} "
                             "calls with caches already compiled")
        self.stats.calls += 1
        return out
