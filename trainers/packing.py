"""Padding-free passes: the valid tokens of ragged rows packed into one sequence per pack.

TRL's batch is ids (B, L), mask (B, L); row b holds n_b valid tokens in one contiguous run
[f_b, f_b + n_b), and targets[b, t] is the token the hidden state at (b, t) is scored against
(−100: none). Packed, the rows with a target go one after another into packs of T ≤ `max_tokens`
tokens (a longer row gets a pack of its own):

    pack index     t' = o_b + i        o_b = Σ_{b' before b} n_b',  i ∈ [0, n_b)
    source         ids_flat[b·L + f_b + i]
    position_ids   i                   (restarts at 0 for every row; no attention_mask)
    cu_seqlens     [o_0, o_1, …, T]    (int32: the varlen kernels' row boundaries)

and only the N scored positions reach the head; `unpack` scatters the (N,) results back to
(B, L) (`plan_target_packs`) or, for GRPO's last K columns (`plan_packs`: token j scored by the
hidden state at j − 1), to (B, K), with 0 elsewhere, so TRL's loss code is unchanged. Every
result equals the padded pass's up to rounding: packed rows start at position 0, which RoPE
turns into rounding of the rotation angles only. `packed_logprobs` is GRPO's whole pass:
plan, one forward per pack (`packed_hidden`), one head call on the (N, H) rows, unpack.

Which kind of attention keeps the rows apart, and whether a model packs at all, is
`trainers.attention`'s decision; this module only runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention import VARLEN_KINDS, pack_context
from .head import forward_hidden_states, head_logprobs


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
        position_ids), plus the row boundaries for the kinds that take them."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if kind in VARLEN_KINDS:
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
    input_ids: torch.Tensor, attention_mask: torch.Tensor, K: int, *, max_tokens: int,
    if_shorter: bool = False,
) -> PackPlan | None:
    """Pack the rows of `input_ids` (B, L) greedily, in order, into packs of ≤ `max_tokens`
    tokens, scoring the last K columns (GRPO's log-prob passes: module docstring), with the
    (B, K) output TRL's `_get_per_token_logps_and_entropies` returns. None when some row's
    valid tokens are not one contiguous run with at least one prompt token before column
    L − K (only the padded path is exact then).

    `plan_target_packs` with the targets "token j scored by the hidden state at j − 1, for the
    valid tokens of the K completion columns", its (B, L) output indices then moved to (B, K);
    `if_shorter` as there.
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
    plan = plan_target_packs(input_ids, attention_mask, targets, max_tokens=max_tokens,
                             if_shorter=if_shorter)
    if plan is None or not plan.packs:
        return plan
    # b·L + t  ->  b·K + (t − c0)
    out = plan.out_index
    plan.out_index = torch.div(out, L, rounding_mode="floor") * K + out % L - c0
    plan.K = K
    return plan


def plan_target_packs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor, *,
    max_tokens: int, if_shorter: bool = False,
) -> PackPlan | None:
    """Pack the rows of `input_ids` (B, L) whose `targets` (B, L) score anything, greedily, in
    order, into packs of ≤ `max_tokens` tokens. targets[b, t] is the token the hidden state at
    (b, t) is scored against, −100 for none (a causal LM's shifted labels); the output is (B, L)
    (`K = L`): out_index = b·L + t.

    None when a row with a target has valid tokens that are not one contiguous run, or a target
    at a position outside that run (its hidden state would be a padding token's): only the
    padded path is exact then. Rows without a target are left out (padded, they only ever
    produce zeros). An empty plan (no packs) means the padded pass: nothing is scored, or
    `if_shorter` is set and the packs would hold all B · L tokens (a batch without padding or an
    unscored row: packing would remove nothing and only make the position inputs per token,
    (T, D) RoPE tables against the padded pass's (L, D)).

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
    if if_shorter and sum(n[b] for b in rows) == B * L:
        rows = []  # nothing to remove: the padded pass

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
    `forward(model_inputs) -> (1, T, H)` per pack, inside `trainers.attention.pack_context`."""
    hidden = []
    for pack in plan.packs:
        with pack_context(kind):
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
    if_shorter: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, str | None]:
    """((logps (B, K) fp32, entropies (B, K) or None) or None, a note to log once or None) for
    the last K columns of `input_ids` (B, L), from packed forwards of `model` (module docstring).

    The per-row results are the padded pass's (0 wherever `attention_mask` is 0), up to
    rounding (positions restart per row: module docstring); the head is
    `linear_logprobs(h, weight, targets, bias=bias, temperature=..., return_entropy=...,
    entropy_requires_grad=...)` on the N scored rows. `kind` is `trainers.attention`'s; each
    model call runs inside `autocast()` (the trainer's `accelerator.autocast`). None means
    padded forwards instead: with a note when the mask is not packable (`plan_packs`), without
    one when no row has a completion token (the padded pass computes those zeros, and the
    autograd graph a loss on them needs) or, with `if_shorter`, when packing would remove no
    token (`plan_target_packs`).
    """
    plan = plan_packs(input_ids, attention_mask, K, max_tokens=max_tokens, if_shorter=if_shorter)
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
