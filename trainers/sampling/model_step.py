"""A functional forward of a Llama-family decoder over our static KV cache.

The forward reads the model's own modules at every call: the embedding, each layer's
`input_layernorm`, `self_attn.{q,k,v,o}_proj` (Qwen2's q/k/v biases and Qwen3's `q_norm` /
`k_norm` come with the modules), `post_attention_layernorm` and `mlp`, the final `norm` and the
LM head. A bitsandbytes 4-bit base layer or a PEFT LoRA wrapper therefore runs as it is, reading
its weights live, so a replay after an optimizer step sees the updated policy. RoPE is the
model's own `rotary_emb(x, position_ids)` (Llama-3 scaling included), called once per cache size
over the positions [0, M) (`rope_table`, eager, at the prefill): a token's cos and sin are the
table's row at its position, the values the module returns for that position (each is one fp32
product of the position and an inverse frequency, then cos / sin, whatever the call's shape),
so a decode step reads them with no matmul; the attention scale is the module's own `scaling`
(head_dim ** -0.5).

Layout: row b's prompt of P_b tokens occupies cache slots [0, P_b), its t-th new token slot
P_b + t, and the position id of every token is its slot: the positions HF assigns a left-padded
row (cumsum of the mask - 1), so the two forwards compute the same function.

    prefill(ids (B, S) left-aligned, lengths (B,))  writes slots [0, S), returns the logits at
        slot lengths_b - 1 (B, V) fp32; slots >= lengths_b hold garbage that decoding overwrites
        before any query can see it
    decode(tokens (B,), slots (B,))  writes slot slots_b, attends to slots <= slots_b,
        returns (B, V) fp32

Attention is SDPA with a mask over the whole cache (a decode step's GQA without expanding K and
V, `_attention`; a decode step makes the additive mask SDPA would make of the boolean one once,
not in every layer); keys outside a row's valid length are masked, never read into the result.
With the plan's `attention` a decode step runs `decode_attention` instead, which reads only each
row's valid keys. A sliding window w (Mistral, Qwen2 / Qwen3 sliding layers) adds
the condition q - k < w, as HF's sliding mask does.
Logits are the head's output in the model dtype, then fp32, as HF's `generate` takes them; with
the plan's `head`, a decode step's head is `head_logits` (the same values up to the order of
the fp32 sums).

With a `kernel_plan.KernelPlan`, decode steps run the planned projections through
`decode_linear` (an MLP of LlamaMLP's form as down(act(gate(x)) · up(x)), projection by
projection; q/k/v and gate/up in one launch each where the plan groups them, `decode_linears`,
with silu(gate) · up formed in the gate/up launch where the plan says so, `decode_silu_mul`),
and both forwards fuse each residual add with the RMSNorm that follows it
(`add_rmsnorm`): the residual stream then carries the last block's output `delta` not yet added
to `h`, and the next norm (a layer's input norm, or the final norm) adds it. With the plan's
`rope`, a decode step's q/k norms (Qwen3), RoPE and cache write of each layer run as one
`rope_cache_write` on the projections' outputs, reading the cos / sin tables at each row's slot
itself (the prefill keeps the torch ops); with the plan's `rope_attention` in the attention's
launch (`rope_attention`). With the plan's `embed`, a decode step's embedding
lookup runs inside the first layer's input `add_rmsnorm` (`ids=`). With the plan's
`rope_sums` (`norm_sums`), a q/k/v (o_proj, down_proj) launch that splits K hands
`rope_cache_write` (`add_rmsnorm`) its partials (`kernels.split_sum.SplitSum`), which that
kernel sums as the projection would have. With the plan's `lora_t`, the add_rmsnorm before a
q/k/v or gate/up launch also forms LoRA's t = x @ Aᵀ of that launch's factors
(`kernels.lora_t`), which the launch sums instead of forming it in every tile. All compute the
modules' own functions within bf16 rounding (the kernels' docstrings state the bounds; RoPE
without q/k norms is bit for bit).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .decode_attention import decode_attention, rope_attention
from .kernel_plan import TORCH, KernelPlan
from .kernels.head_logits import head_logits
from .kernels.linear4bit import decode_linear, decode_linears, decode_silu_mul, lora_factors
from .kernels.rmsnorm import add_rmsnorm
from .kernels.rope import norm_params, rope_cache_write
from .kernels.split_sum import SplitSum

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE types whose inverse frequencies are fixed at init; "dynamic" and "longrope" recompute
# them from the sequence length at every call (a host read of the largest position).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# rotary_emb module -> {(M, dtype, device): (cos, sin) (M, D)}: kept as long as the model, since
# a captured graph reads the tables it was captured with
_ROPE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def base_model(model):
    """The transformers causal LM under a PEFT wrapper (or `model` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def model_reason(model) -> str | None:
    """Why `model` is not a decoder this forward computes, or None."""
    base = base_model(model)
    config = getattr(base, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model type {family!r} (the decode loop covers {', '.join(FAMILIES)})"
    inner = getattr(base, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"{type(base).__name__}.model has no {name!r}"
    if base.get_output_embeddings() is None:
        return f"{type(base).__name__} has no output embeddings"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r} (supported: {', '.join(STATIC_ROPE)})"
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"):
            if not hasattr(attn, name):
                return f"layer {i} attention has no {name!r}"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit softcapping"
    return None


def sliding_windows(base) -> list[int | None]:
    """Each layer's sliding window w (keys with q - k >= w are hidden), or None for full."""
    config = base.config
    out = []
    for layer in base.model.layers:
        attn = layer.self_attn
        if config.model_type == "mistral":
            out.append(getattr(config, "sliding_window", None))
        else:  # qwen2 / qwen3 store the window on sliding layers only; llama has none
            out.append(getattr(attn, "sliding_window", None))
    return out


def qkv_modules(attn) -> tuple:
    """An attention module's q, k and v projections, in the grouped launch's order."""
    return attn.q_proj, attn.k_proj, attn.v_proj


def _rmsnorm_t(x, residual, norm, lora_a, **kw):
    """`add_rmsnorm`'s (y, r', t) with `norm`'s weight and eps; t (LoRA's, `kernels.lora_t`)
    None without factors."""
    out = add_rmsnorm(x, residual, norm.weight, norm.variance_epsilon, lora_a=lora_a, **kw)
    return out if lora_a is not None else (*out, None)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin):
    # x (B, H, S, D), cos / sin (B, S, D): x·cos + rotate_half(x)·sin, per position
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _attention(q, K, V, mask, scale):
    """softmax(q Kᵀ · scale, masked) V for q (B, H, S, D) over K, V (B, H_kv, M, D), query
    head h reading kv head h // G (G = H / H_kv, HF's `repeat_kv` order).

    One decode token (S = 1): the G query heads of a kv head share its mask, so they are laid out
    as G queries of one head, q -> (B, H_kv, G, D), and attend without expanding K and V
    (SDPA's GQA flag would take the math backend, which copies K and V G times per layer);
    the mask (B, 1, 1, M) broadcasts over them."""
    B, H, S, D = q.shape
    Hkv = K.shape[1]
    if S == 1 and Hkv != H:
        o = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, D), K, V,
                                           attn_mask=mask, scale=scale)
        return o.reshape(B, H, 1, D)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scale,
                                          enable_gqa=Hkv != H)


class ModelStep:
    """Prefill and decode over `cache` (a `trainers.sampling.cache.KVCache`) for one model."""

    def __init__(self, model, plan: KernelPlan = TORCH):
        self.plan = plan
        self.base = base_model(model)
        self.inner = self.base.model
        self.head = self.base.get_output_embeddings()
        self.layers = list(self.inner.layers)
        self.windows = sliding_windows(self.base)

    def _proj(self, module, x, fused, defer_sum=False):
        """module(x); with `defer_sum`, a split fused projection's output may be left as a
        SplitSum for the kernel that reads it next (`kernels.split_sum`)."""
        if fused and id(module) in self.plan.fused:
            return decode_linear(x, module, defer_sum=defer_sum)
        return module(x)

    def _projs(self, modules, x, fused, defer_sum=False, lora_t=None):
        """[module(x) for module in modules], projections of one input: one launch where the
        plan groups them (with LoRA's t of x from the norm before, `lora_t`)."""
        if fused and tuple(id(m) for m in modules) in self.plan.groups:
            return decode_linears(x, modules, defer_sum=defer_sum, lora_t=lora_t)
        return [self._proj(m, x, fused, defer_sum) for m in modules]

    def _mlp(self, mlp, x, fused, lora_t=None):
        if fused and id(mlp) in self.plan.split_mlp:  # LlamaMLP's forward, piece by piece
            if id(mlp) in self.plan.silu_mul:
                h = decode_silu_mul(x, mlp.gate_proj, mlp.up_proj, lora_t=lora_t)
            else:
                gate, up = self._projs((mlp.gate_proj, mlp.up_proj), x, fused, lora_t=lora_t)
                h = mlp.act_fn(gate) * up
            return self._proj(mlp.down_proj, h, fused, self.plan.norm_sums)
        return mlp(x)

    def _norm_lora(self, modules, fused):
        """The LoRA factors of a group whose t the norm before it forms (the plan's `lora_t`:
        the group's launch sums it instead of forming it), else None."""
        if fused and tuple(id(m) for m in modules) in self.plan.lora_t:
            return lora_factors(modules)
        return None

    def _add_norm(self, delta, h, norm, lora_a=None):
        """(norm(h + delta), h + delta, t); delta None: (norm(h), h, t). t: `lora_t.LoraT` of
        the norm's output and the factors `lora_a` (add_rmsnorm's), None without them."""
        if not self.plan.norms:
            if isinstance(delta, SplitSum):  # a plan with norm_sums but not norms
                delta = delta.materialize()
            h = h if delta is None else h + delta
            return norm(h), h, None
        return _rmsnorm_t(h if delta is None else delta, None if delta is None else h, norm,
                          lora_a)

    def _qkv(self, attn, x, cos, sin, fused, lora_t=None):
        B, S, _ = x.shape
        D = attn.head_dim
        q, k, v = (y.view(B, S, -1, D) for y in
                   self._projs(qkv_modules(attn), x, fused, lora_t=lora_t))
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over the head dim, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _qkv_heads(self, attn, x, lora_t=None):
        """One decode token per row: the projections' (B, 1, H·D) outputs (or SplitSums) read
        through (B, H, D) views. lora_t: as `_projs`'."""
        B, _, _ = x.shape
        D = attn.head_dim
        return [y.view(B, -1, D) for y in self._projs(qkv_modules(attn), x, True,
                                                       self.plan.rope_sums, lora_t)]

    def _qkv_write(self, attn, x, cos, sin, cache_k, cache_v, slots, lora_t=None):
        """The projections (`_qkv_heads`), then `rope_cache_write` writes rotated k and v to
        slot slots_b of cache_k / cache_v (B, H_kv, M, D) and returns rotated q (B, H, 1, D).
        cos, sin: the (M, D) tables, row b's position is slots_b."""
        q, k, v = self._qkv_heads(attn, x, lora_t)
        norms = norm_params(attn)  # Qwen3's q_norm / k_norm, or None
        q = rope_cache_write(q, k, v, cos, sin, cache_k, cache_v, slots,
                             q_norm=norms and norms[0], k_norm=norms and norms[1], tables=True)
        return q[:, :, None]

    def _qkv_attend(self, i, attn, x, cos, sin, cache_k, cache_v, slots, lora_t=None):
        """The projections (`_qkv_heads`), then RoPE, the cache write and the attention over
        each row's keys in one launch (`rope_attention`): o (B, H, 1, D)."""
        q, k, v = self._qkv_heads(attn, x, lora_t)
        B, H, D = q.shape
        norms = norm_params(attn)
        o = rope_attention(q, k, v, cos, sin, cache_k, cache_v, slots, scale=attn.scaling,
                           window=self.windows[i], q_norm=norms and norms[0],
                           k_norm=norms and norms[1])
        return o.reshape(B, H, 1, D)

    def rope_table(self, M: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (M, D) in like's dtype: `rotary_emb` at positions [0, M), computed on the
        first call for this (M, dtype, device) (module docstring)."""
        tables = _ROPE_TABLES.setdefault(self.inner.rotary_emb, {})
        key = (M, like.dtype, like.device)
        table = tables.get(key)
        if table is None:
            cos, sin = self.inner.rotary_emb(like, torch.arange(M, device=like.device)[None])
            table = tables[key] = (cos[0], sin[0])
        return table

    def _layers(self, h, cos, sin, attend, write, keys, fused=False, qkv_write=None,
                first=None, qkv_attend=None):
        """Runs every layer, with RoPE's cos / sin (B or 1, S, D): `write(i, k, v)` stores this
        step's keys and values in layer i's cache; `keys(i)` returns the (K, V) the queries
        attend to; `attend(q, K, V, window, scale)` the attention output (B, H, S, D). `fused`:
        the plan's projections run through decode_linear. `qkv_write(i, attn, x, cos, sin)`, if
        given, replaces the projections, RoPE and `write` (it returns q; its last argument is
        LoRA's t from the norm, or None). `qkv_attend(i, attn, x, cos, sin, t)`, if given,
        replaces those and the attention too (it returns o). `first`: (x, h, t) of the first
        layer's input norm, formed by the caller. Returns (h, delta): the residual stream is
        h + delta."""
        delta = None  # the last block's output, not yet added to h
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if i == 0 and first is not None:
                x, h, t = first
            else:
                x, h, t = self._add_norm(delta, h, layer.input_layernorm,
                                         self._norm_lora(qkv_modules(attn), fused))
            if qkv_attend is not None:
                o = qkv_attend(i, attn, x, cos, sin, t)
            else:
                if qkv_write is not None:
                    q = qkv_write(i, attn, x, cos, sin, t)
                else:
                    q, k, v = self._qkv(attn, x, cos, sin, fused, t)
                    write(i, k, v)
                K, V = keys(i)
                o = attend(q, K, V, self.windows[i], attn.scaling)
            B, H, S, D = o.shape
            a = self._proj(attn.o_proj, o.transpose(1, 2).reshape(B, S, H * D), fused,
                           self.plan.norm_sums)
            mlp = layer.mlp
            gate_up = (mlp.gate_proj, mlp.up_proj) if id(mlp) in self.plan.split_mlp else ()
            x, h, t = self._add_norm(a, h, layer.post_attention_layernorm,
                                     self._norm_lora(gate_up, fused))
            delta = self._mlp(mlp, x, fused, t)
        return h, delta

    def _logits(self, h, delta, fused=False):
        n, _, _ = self._add_norm(delta, h, self.inner.norm)
        if fused and self.plan.head:
            return head_logits(n, self.head)
        return self.head(n).float()

    def prefill(self, cache, ids, lengths):
        """ids (B, S) with row b's prompt in [0, lengths_b); returns the logits (B, V) fp32 at
        slot lengths_b - 1 and writes slots [0, S) of every layer."""
        B, S = ids.shape
        dev = ids.device
        pos = torch.arange(S, device=dev)
        causal = pos[None, :] <= pos[:, None]  # (S_q, S_k)
        valid = pos[None, None, :] < lengths[:, None, None]  # (B, 1, S_k)
        # A query past its row's prompt (its output is never used) still sees its own key, so no
        # softmax row is empty (an empty row would put NaN into the garbage slots).
        diag = torch.eye(S, dtype=torch.bool, device=dev)
        masks = {}
        for w in set(self.windows):
            m = causal & valid
            if w is not None:
                m = m & (pos[:, None] - pos[None, :] < w)
            masks[w] = (m | diag)[:, None]  # (B, 1, S, S)

        def write(i, k, v):
            cache.k[i, :, :, :S] = k
            cache.v[i, :, :, :S] = v

        def keys(i):
            return cache.k[i, :, :, :S], cache.v[i, :, :, :S]

        def attend(q, K, V, window, scale):
            return _attention(q, K, V, masks[window], scale)

        h = self.inner.embed_tokens(ids)
        cos, sin = self.rope_table(cache.capacity, h)
        h, delta = self._layers(h, cos[None, :S], sin[None, :S], attend, write, keys)
        last = (torch.arange(B, device=dev), (lengths - 1).clamp(min=0))
        # (B, hidden): only these rows reach the head
        return self._logits(h[last], None if delta is None else delta[last])

    def decode(self, cache, tokens, slots):
        """tokens (B,) at positions `slots` (B,); writes them to the cache, returns (B, V) fp32."""
        B = tokens.shape[0]
        M = cache.k.shape[3]
        dev = tokens.device
        # what only the torch paths read is made only for them, so a step whose kernels take
        # slots directly launches none of it: the SDPA mask on first use, the rows of the
        # cache write where rope_cache_write does not write the cache
        additive = {}  # (window, dtype) -> 0 where a key is seen, -inf where not (B, 1, 1, M)
        rows = None if self.plan.rope else torch.arange(B, device=dev)

        def write(i, k, v):
            # k (B, H_kv, 1, D) -> slot slots_b of row b; indices separated by a slice put the
            # broadcast (B,) dimension first: the target view is (B, H_kv, D)
            cache.k[i][rows, :, slots] = k[:, :, 0].to(cache.k.dtype)
            cache.v[i][rows, :, slots] = v[:, :, 0].to(cache.v.dtype)

        def keys(i):
            return cache.k[i], cache.v[i]

        def attend(q, K, V, window, scale):
            D = q.shape[-1]
            if self.plan.attention:  # valid keys only (kernel_plan checked D)
                Hkv, G = K.shape[1], q.shape[1] // K.shape[1]
                o = decode_attention(q.reshape(B, Hkv, G, D), K, V, slots,
                                     scale=scale, window=window)
                return o.reshape(B, Hkv * G, 1, -1)
            # what SDPA would build from the boolean mask in every layer, built in the first
            mask = additive.get((window, q.dtype))
            if mask is None:
                kpos = torch.arange(M, device=dev)
                seen = kpos[None, :] <= slots[:, None]  # (B, M)
                if window is not None:
                    seen = seen & (slots[:, None] - kpos[None, :] < window)
                mask = additive[window, q.dtype] = torch.zeros(
                    B, 1, 1, M, dtype=q.dtype, device=dev).masked_fill_(
                    ~seen[:, None, None, :], float("-inf"))
            return _attention(q, K, V, mask, scale)

        def qkv_write(i, attn, x, cos, sin, lora_t):
            return self._qkv_write(attn, x, cos, sin, cache.k[i], cache.v[i], slots, lora_t)

        def qkv_attend(i, attn, x, cos, sin, lora_t):
            return self._qkv_attend(i, attn, x, cos, sin, cache.k[i], cache.v[i], slots, lora_t)

        first = None
        if self.plan.embed:  # the lookup inside layer 0's input norm: (x, h, t) (B, 1, hidden)
            norm = self.layers[0].input_layernorm
            lora_a = self._norm_lora(qkv_modules(self.layers[0].self_attn), True)
            first = _rmsnorm_t(self.inner.embed_tokens.weight, None, norm, lora_a,
                               ids=tokens[:, None])
            h = first[1]
        else:
            h = self.inner.embed_tokens(tokens[:, None])  # (B, 1, hidden)
        cos, sin = self.rope_table(M, h)
        if not self.plan.rope:  # rope_cache_write reads the tables at each row's slot itself
            cos, sin = cos[slots][:, None], sin[slots][:, None]  # (B, 1, D)
        h, delta = self._layers(h, cos, sin, attend, write, keys, fused=True,
                                qkv_write=qkv_write if self.plan.rope else None, first=first,
                                qkv_attend=qkv_attend if self.plan.rope_attention else None)
        # delta (B, 1, hidden), possibly a SplitSum (the last down_proj's): (B, hidden)
        return self._logits(h[:, 0], None if delta is None else delta.reshape(B, -1), fused=True)
