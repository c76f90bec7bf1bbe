"""Padding-free log-prob passes: the valid tokens of ragged GRPO rows packed into one sequence.

TRL hands every log-prob pass (policy, old policy, reference) a prompt + completion batch

    ids (B, L), mask (B, L)      L = P + K; row b holds n_b valid tokens in one contiguous run
                                 [f_b, f_b + n_b): prompt left-padded, completion right-padded

and scores the K completion columns: token (b, j), j ∈ [L − K, f_b + n_b), by the hidden state
at (b, j − 1). Padded, the backbone runs on B·L positions of which only Σ_b n_b are real (56 %
in the end-to-end benchmark's batches). Packed, the rows of a pack go one after another into a
single sequence of T = Σ_b n_b tokens:

    pack index     t = o_b + i         o_b = Σ_{b' before b} n_b',  i ∈ [0, n_b)
    source         ids_flat[b·L + f_b + i]
    position_ids   i                   (restarts at 0 for every row)
    cu_seqlens     [o_0, o_1, …, T]    (int32, flash attention's varlen boundaries)

and the scored tokens, in pack coordinates:

    hidden index   t − 1 = o_b + (j − f_b) − 1      (≥ o_b: the prompt holds ≥ 1 token)
    target         ids[b, j]
    output index   b·K + j − (L − K)                into the flat (B·K) result

so the head sees only (N, H) rows, N = Σ_b (completion tokens of b), and `unpack` scatters the
(N,) log-probs / entropies back to TRL's (B, K) with 0 elsewhere: TRL's loss code is unchanged.
Rows with no completion token (e.g. truncated ones under `mask_truncated_completions`) are left
out of the packs: padded, they only ever produce zeros.

One call runs it all: `packed_logprobs(model, ids, mask, K, kind=..., max_tokens=..., weight=W,
bias=b, ...)` plans the packs (`plan_packs`), runs one forward per pack through the wrapped model
(`trainers.head.forward_hidden_states`, inside `trainers.varlen.packed_forward` for
"sdpa_varlen": `packed_hidden`), gathers the (N, H) hidden states that score a token, runs the
head once on them and returns TRL's (B, K) log-probs (and entropies), or None when the batch
stays padded. The trainer only chooses the kind (`choose_packing`, below) and calls it.

Any labels. The plan is one case of `plan_target_packs(ids, mask, targets)`, for a causal LM's
shifted labels in the same (B, L) layout, targets[b, t] the token the hidden state at (b, t) is
scored against (−100: none): a row's valid tokens must be one contiguous run holding every
position that scores a target, the output is (B, L) (out_index = b·L + t). GRPO's plan is that
with the K completion tokens as targets, its output indices moved to (B, K);
`trainers.fused_forward` (the DPO / KTO / RLOO trainers) uses it directly on the labels TRL
passes its fused LM head, with the backbone itself as the per-pack forward.

How rows stay apart. With `position_ids` given and no `attention_mask` and no cache,
transformers 5.x finds the restarts (`masking_utils.find_packed_sequence_indices`) and
restricts attention to each row. What that costs depends on the attention implementation
(the mask function transformers registers for `config._attn_implementation`):

    "varlen"  flash_attention_2/3/4 and hub flash kernels: flash_attn_varlen_func over
              cu_seqlens, no mask at all. `cu_seq_lens_q/k`, `max_length_q/k` are passed
              explicitly, so transformers skips its per-layer scan of position_ids.
    "block"   flex_attention: a BlockMask, O((T/128)²) block indices; fully masked blocks
              between rows are skipped.
    "sdpa_varlen"  sdpa models on CUDA in fp16/bf16: switched to `trainers.varlen.IMPL`, which
              is sdpa for every other call and PyTorch's own varlen FlashAttention
              (`torch.nn.attention.varlen`) over the same cu_seqlens for packed ones, with no
              mask (see trainers.varlen; no flash-attn install needed).
    "dense"   eager, and sdpa where varlen_attn cannot run (CPU, fp32, sliding windows, ...): a
              dense (1, 1, T, T) mask. Correct, but T² mask bytes and T² attention work instead
              of B·L², i.e. more, not less, once T > L·√B.

so `packing="auto"` packs for "varlen", "block" and "sdpa_varlen"; `packing=True` also packs
under a "dense" implementation (with a warning), which is how the CPU tests check correctness.

Positions. Packed rows start at position 0, as generation saw them (transformers derives
positions from the attention mask, vLLM never pads); TRL's padded forward numbers a left-padded
row from its pad count. With RoPE only relative positions enter attention, so both give the
same log-probs up to the rounding of the rotation angles (~1e-6 in fp32 for the tiny test
models); with learned absolute positions the packed pass is the one that matches generation.

Memory. Each pack holds at most `max_tokens` tokens; the trainer's default is TRL's chunk,
`batch_size · L`, so a pack is never larger than the padded chunk it replaces (and Σ n_b ≤ B·L
means one pack per padded chunk at most). A row longer than `max_tokens` gets a pack of its own.

Benchmark (packed vs padded, same trainer and batch; e.g. a Llama-3.2-1B shape, B=8, L=1024 /
4096, the e2e benchmark's ragged fill). Any of the packing attentions above works: the default
sdpa (on CUDA, bf16), attn_implementation="flash_attention_2" (flash-attn installed) or
`model.set_attn_implementation("flex_attention")` (compiled on first use per shape: warm up).

    ids, mask = synthetic_ragged_batch(8, 64, 1024, vocab, device="cuda")
    for packing in (False, "auto"):
        tr.packing = packing                       # tr: a trainers.GRPOTrainer
        with torch.no_grad():                      # reference / old-policy pass
            tr._get_per_token_logps_and_entropies(tr.model, ids, mask, 1024, batch_size=8)
        logp, ent, _ = tr._get_per_token_logps_and_entropies(       # policy pass, fwd + bwd
            tr.model, ids, mask, 1024, batch_size=8, compute_entropy=True)
        (logp * mask[:, -1024:]).sum().backward()

Time each (median ms of CUDA-synchronised repeats) and record the peak extra memory; also
time `compute_loss` + backward on TRL's inputs dict. Report the real-token fraction Σ n_b / B·L
next to the speed-up: packing should win by roughly that ratio in the backbone and not at all in
the head (which already skips padding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
)

from . import varlen
from .head import forward_hidden_states, head_logprobs
from .models import PeftModel, unwrap_causal_lm, unwrap_model

# Layer kinds that only attend: packing relies on attention being the one place where tokens
# of different rows meet. Recurrent or convolutional layers (Mamba, linear attention) carry
# state across the row boundary, so models with them are never packed.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass
class Pack:
    """One forward call: R rows packed into T tokens (see the module docstring)."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T)  i, restarting at 0 per row
    cu_seqlens: torch.Tensor  # (R + 1,) int32  row boundaries o_b, then T
    max_seqlen: int  # max_b n_b
    hidden_index: torch.Tensor  # (N_p,) the positions t − 1 whose hidden states score a token

    def model_inputs(self, kind: str | None) -> dict:
        """Keyword arguments of the model call: no attention_mask (rows are told apart by
        position_ids), plus the varlen boundaries for the "varlen" and "sdpa_varlen" kinds."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if kind in ("varlen", "sdpa_varlen"):
            inputs.update(
                cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                max_length_q=self.max_seqlen, max_length_k=self.max_seqlen,
            )
        return inputs


@dataclass
class PackPlan:
    """The packs of one (B, L) batch and where their N scored tokens go in the (B, K) output."""

    packs: list[Pack]
    targets: torch.Tensor  # (N,) the token each scored hidden state is scored against
    out_index: torch.Tensor  # (N,) its place in the flat (B·K) output
    B: int
    K: int  # output width: the K completion columns (plan_packs), or L (plan_target_packs)


def plan_packs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, K: int, *, max_tokens: int
) -> PackPlan | None:
    """Pack the rows of `input_ids` (B, L) greedily, in order, into packs of ≤ `max_tokens`
    tokens, scoring the last K columns (GRPO's log-prob passes: module docstring), with the
    (B, K) output TRL's `_get_per_token_logps_and_entropies` returns. None when some row's
    valid tokens are not one contiguous run with at least one prompt token before column
    L − K (only the padded path is exact then).

    `plan_target_packs` with the targets "token j scored by the hidden state at j − 1, for the
    valid tokens of the K completion columns", its (B, L) output indices then moved to (B, K).
    """
    B, L = input_ids.shape
    if K >= L:  # no prompt column: the first completion token has no hidden state before it
        if bool(attention_mask.bool().any()):
            return None
        return PackPlan([], input_ids.new_zeros(0), input_ids.new_zeros(0), B, K)
    c0 = L - K - 1  # the hidden state at column c0 scores the first completion column
    completion = input_ids[:, L - K:].masked_fill(attention_mask[:, L - K:] == 0, -100)
    targets = input_ids.new_full((B, L), -100)
    targets[:, c0:L - 1] = completion
    plan = plan_target_packs(input_ids, attention_mask, targets, max_tokens=max_tokens)
    if plan is None:
        return None
    # b·L + t  ->  b·K + (t − c0)
    out = plan.out_index
    plan.out_index = torch.div(out, L, rounding_mode="floor") * K + out % L - c0
    plan.K = K
    return plan


def plan_target_packs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor, *,
    max_tokens: int,
) -> PackPlan | None:
    """Pack the rows of `input_ids` (B, L) whose `targets` (B, L) score anything, greedily, in
    order, into packs of ≤ `max_tokens` tokens. targets[b, t] is the token the hidden state at
    (b, t) is scored against, −100 for none (a causal LM's shifted labels); the output is (B, L)
    (`K = L`): out_index = b·L + t.

    None when a row with a target has valid tokens that are not one contiguous run, or a target
    at a position outside that run (its hidden state would be a padding token's): only the
    padded path is exact then. Rows without a target are left out (padded, they only ever
    produce zeros).

    One host read (the (2, B, L) masks); the index maps are built on the CPU from it and
    copied to the device, a few (T,) int64 tensors per pack.
    """
    B, L = input_ids.shape
    targets = targets.to(input_ids.device)
    masks = torch.stack([attention_mask.bool(), targets != -100]).cpu()  # the one host sync
    mask, scored = masks[0], masks[1]  # (B, L) each
    first_t = mask.int().argmax(-1)  # (B,) f_b (argmax returns the first maximum)
    n_t = mask.sum(-1)  # (B,) n_b
    last = (L - 1 - mask.flip(-1).int().argmax(-1)).tolist()  # f_b + n_b − 1 when n_b > 0
    s_first = scored.int().argmax(-1).tolist()  # the first and last scored positions
    s_last = (L - 1 - scored.flip(-1).int().argmax(-1)).tolist()
    has = scored.any(-1).tolist()
    first, n = first_t.tolist(), n_t.tolist()

    rows = []
    for b in range(B):
        if not has[b]:
            continue  # nothing scored: all zeros, padded or not
        if n[b] == 0 or last[b] - first[b] + 1 != n[b] or not first[b] <= s_first[b] <= \
                s_last[b] <= last[b]:
            return None  # holes in the mask, or a target scored by a padding position
        rows.append(b)

    groups, current, tokens = [], [], 0
    for b in rows:
        if current and tokens + n[b] > max_tokens:
            groups.append(current)
            current, tokens = [], 0
        current.append(b)
        tokens += n[b]
    if current:
        groups.append(current)

    device = input_ids.device
    ids_flat, scored_flat = input_ids.reshape(-1), scored.reshape(-1)
    packs, src_scored = [], []
    for group in groups:
        r = torch.tensor(group)  # (R,) batch rows in this pack
        n_r = n_t[r]  # (R,)
        cu = torch.zeros(len(group) + 1, dtype=torch.long)
        cu[1:] = n_r.cumsum(0)  # (R + 1,) o_b, then T
        T = int(cu[-1])
        row_of = torch.repeat_interleave(torch.arange(len(group)), n_r)  # (T,) which row
        i = torch.arange(T) - cu[:-1][row_of]  # (T,) position within its row
        col = first_t[r][row_of] + i  # (T,) column t in the padded batch
        src = r[row_of] * L + col  # (T,) flat index b·L + t
        hit = scored_flat[src]  # (T,) the hidden state at this token scores a target
        packs.append(Pack(
            input_ids=ids_flat[src.to(device)].unsqueeze(0),
            position_ids=i.unsqueeze(0).to(device),
            cu_seqlens=cu.to(device=device, dtype=torch.int32),
            max_seqlen=int(n_r.max()),
            hidden_index=hit.nonzero().squeeze(1).to(device),
        ))
        src_scored.append(src[hit])
    if not packs:
        return PackPlan([], input_ids.new_zeros(0), input_ids.new_zeros(0), B, L)
    out_index = torch.cat(src_scored).to(device)  # (N,) b·L + t
    return PackPlan(packs, targets.reshape(-1)[out_index], out_index, B, L)


def unpack(values: torch.Tensor, plan: PackPlan) -> torch.Tensor:
    """(N,) per scored token -> (B, K), 0 (False) at every other position; differentiable in
    `values`."""
    out = values.new_zeros(plan.B * plan.K)  # (B·K,)
    return out.index_copy(0, plan.out_index.to(out.device), values).view(plan.B, plan.K)


def packed_hidden(plan: PackPlan, kind: str, forward: Callable[[dict], torch.Tensor]
                  ) -> torch.Tensor:
    """(N, H): the hidden states that score `plan.targets`, in order, from one call
    `forward(model_inputs) -> (1, T, H)` per pack (inside `varlen.packed_forward` for the
    "sdpa_varlen" kind)."""
    in_pack = varlen.packed_forward if kind == "sdpa_varlen" else contextlib.nullcontext
    hidden = []
    for pack in plan.packs:
        with in_pack():
            h = forward(pack.model_inputs(kind))  # (1, T, H)
        hidden.append(h[0, pack.hidden_index])  # (N_p, H): the states before scored tokens
    return torch.cat(hidden)


# --------------------------------------------------------------------------- the packed pass

_UNPACKABLE = (
    "grpo_lce packing skipped for a batch whose attention_mask is not one contiguous run per row "
    "after a non-empty prompt; using padded forwards."
)


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    K: int,
    *,
    kind: str,
    max_tokens: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_requires_grad: bool = False,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, str | None]:
    """((logps (B, K) fp32, entropies (B, K) or None) or None, a note to log once or None) for
    the last K columns of `input_ids` (B, L), from packed forwards of `model` (module docstring).

    The per-row results are the padded pass's (0 wherever `attention_mask` is 0), up to
    rounding (other positions and row counts: module docstring, "Positions"); the head is
    `linear_logprobs(h, weight, targets, bias=bias, temperature=..., return_entropy=...,
    entropy_requires_grad=...)` on the N scored rows.
    `kind` is `choose_packing`'s; each model call runs inside `autocast()` (the trainer's
    `accelerator.autocast`). None means padded forwards instead: with a note when the mask is
    not packable (`plan_packs`), without one when no row has a completion token (the padded
    pass computes those zeros, and the autograd graph a loss on them needs).
    """
    plan = plan_packs(input_ids, attention_mask, K, max_tokens=max_tokens)
    if plan is None:
        return None, _UNPACKABLE
    if not plan.packs:
        return None, None

    def forward(inputs):
        with autocast():
            return forward_hidden_states(model, **inputs)[0]

    out = head_logprobs(packed_hidden(plan, kind, forward), weight, bias, plan.targets,
                        temperature=temperature, return_entropy=return_entropy,
                        entropy_requires_grad=entropy_requires_grad)  # (N, H) -> (N,)
    if return_entropy:
        return (unpack(out[0], plan), unpack(out[1], plan)), None
    return (unpack(out, plan), None), None


# --------------------------------------------------------------------------- which models pack


def attention_packing_kind(model: torch.nn.Module) -> str | None:
    """"varlen" (flash), "block" (flex), "sdpa_varlen" (trainers.varlen), "dense" (sdpa /
    eager) or None (an implementation without transformers' packed-sequence handling: packed
    rows would see each other). As the model is now; `choose_packing` may switch sdpa."""
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
    if impl == varlen.IMPL:
        return "sdpa_varlen"
    if mask_fn in (sdpa_mask, eager_mask):
        return "dense"
    return None


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
    """(kind to pack with, or None for padded forwards; a warning to log once, or None) for the
    trainer option `packing` in {"auto", True, False} (module docstring: which kinds pack)."""
    if packing is False:
        return None, None
    reason = packing_blocker(model)
    kind = attention_packing_kind(model) if reason is None else None
    lm = unwrap_causal_lm(model)
    impl = lm.config._attn_implementation
    no_varlen = varlen.varlen_blocker(lm) if kind == "dense" else None
    if kind == "dense" and no_varlen is None:
        varlen.use_sdpa_varlen(lm)  # sdpa for every unpacked call, varlen for packed ones
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
    param = next((p for p in lm.parameters() if p.is_floating_point()), None)
    if param is None or not param.is_cuda:
        return f"grpo_lce: log-prob passes stay padded ({impl} on CPU has no packed kernel)."
    if param.dtype not in (torch.float16, torch.bfloat16):
        hint = "train in bf16 or fp16 to pack"
    else:
        hint = "attn_implementation='flash_attention_2' or 'flex_attention' would pack"
    return f"grpo_lce: log-prob passes stay padded ({why}; {hint})."


def synthetic_ragged_batch(
    B: int, P: int, K: int, vocab: int, *, device="cpu", seed: int = 0, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask (B, P + K) shaped like TRL's: prompts of P − ⌊P·b/2B⌋ tokens left-padded to P,
    completions of ⌈K·(b+1)/B⌉ tokens right-padded to K (b = 0…B−1, each shuffled): mean
    completion fill (B + 1)/2B, 56 % at B = 8, as in the end-to-end benchmark's batches."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + K), generator=g)  # 0, 1, 2: pad / bos / eos
    c_len = torch.tensor([-(-K * (b + 1) // B) for b in range(B)])
    c_len = c_len[torch.randperm(B, generator=g)]
    p_len = (P - P * torch.arange(B) // (2 * B))[torch.randperm(B, generator=g)]
    col = torch.arange(P + K)
    mask = ((col[None] >= P - p_len[:, None]) & (col[None] < P + c_len[:, None])).long()
    ids[mask == 0] = pad_id
    return ids.to(device), mask.to(device)
