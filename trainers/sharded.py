"""The full LM head weight when the model's parameters are sharded: FSDP2 and DeepSpeed ZeRO-3.

`grpo_lce` multiplies the hidden states by `lm_head.weight` directly, outside the head module's
forward, so it needs the whole (V, H) weight on every rank. Under the sharded backends that is
not what the attribute holds between forwards:

    FSDP2 (`fully_shard`)   a DTensor, Shard(0) over the data-parallel mesh: (V/P, H) per rank
    DeepSpeed ZeRO-3        a partitioned Parameter of numel 0 (`ds_shape` is (V, H))
    DDP, ZeRO-1/2, single   the plain (V, H) Parameter: nothing to do

`full_head_params(weight, bias)` returns plain (V, H) / (V,) tensors that stay valid for the
whole forward and backward of the loss, gathered as TRL 1.16 gathers its own fused head:

FSDP2: `DTensor.full_tensor()` (an all-gather; TRL's `add_fused_lm_head` does the same). It is
differentiable, and the gradient placements are given as `Partial("avg")`: each rank's dW is
a partial of the data-parallel gradient, so the backward of the gather is a reduce-scatter that
averages over ranks, landing on the sharded parameter's `.grad` exactly like FSDP2's own
reduce-scatter (which also averages). Without that hint DTensor would assume the gradient is
replicated and keep each rank's own, unreduced slice. The full tensor is kept by autograd for
a trainable head (the recompute in backward reads it), so nothing is re-gathered in backward;
the cost is one (V, H) copy per rank while the loss's graph lives. Under a mixed-precision
policy the local shard is cast to the policy's `param_dtype` first (all-gather in bf16, the
dtype FSDP2's own unsharded parameter would have).

ZeRO-3: `deepspeed.zero.GatheredParameters` around a copy (TRL's `maybe_gather_lm_head_ctx`
gathers the same way, skipping parameters already available, e.g. a tied embedding inside its
forward). Only a frozen head is served (LoRA / QLoRA, the main case): grpo_lce then needs W in
the forward only (the gradient basis is built there) and, for an entropy gradient without its
basis, the kept copy in backward. A trainable head's dW would have to reach ZeRO-3's gradient
partitioning hooks, which only fire for parameters used inside a module forward (TRL routes its
loss through the model's forward for this); that is refused with a clear error instead.

FSDP1 (`FullyShardedDataParallel`, flat parameters) is refused by `trainers.head.check_parallelism`.
"""

from __future__ import annotations

import contextlib

import torch

try:  # torch >= 2.4: public DTensor API
    from torch.distributed.tensor import DTensor, Partial
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = Partial = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def is_zero3_param(t) -> bool:
    """A DeepSpeed ZeRO-3 partitioned parameter (carries `ds_id` / `ds_status`)."""
    return hasattr(t, "ds_id") and hasattr(t, "ds_status")


def fsdp2_param_dtype(model: torch.nn.Module, param: torch.Tensor) -> torch.dtype | None:
    """The mixed-precision `param_dtype` of the FSDP2 group owning `param`, or None (no policy,
    or not found). Reads FSDP2's per-module state; private attributes are read defensively."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        group = getattr(state, "_fsdp_param_group", None)
        if group is None:
            continue
        if any(fp.sharded_param is param for fp in getattr(group, "fsdp_params", ())):
            policy = getattr(state, "_mp_policy", None)
            return getattr(policy, "param_dtype", None)
    return None


def _gather_dtensor(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # cast the local shard: the all-gather then moves param_dtype bytes
    # Data-parallel: each rank's gradient is a partial of the average over ranks.
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)


@contextlib.contextmanager
def gathered_zero3(*params: torch.Tensor | None):
    """Gather ZeRO-3 partitioned `params` for the block (TRL 1.16's `maybe_gather_lm_head_ctx`):
    a no-op for parameters that are not partitioned or already available, deduplicated (a tied
    head passed twice would confuse ZeRO-3's bookkeeping)."""
    todo = {id(p): p for p in params if p is not None and is_zero3_param(p)}
    if todo:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        todo = {k: p for k, p in todo.items() if p.ds_status != ZeroParamStatus.AVAILABLE}
    if not todo:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(todo.values()), modifier_rank=None):
        yield


def full_head_params(
    weight: torch.Tensor, bias: torch.Tensor | None, *, model: torch.nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W (V, H), b (V,) or None) as plain tensors, whatever the sharding (see module docstring).

    Plain parameters come back as they are (same object, so autograd accumulates into them).
    `model` (the module tree holding the head) lets an FSDP2 mixed-precision policy be honoured.
    """
    if is_dtensor(weight):
        dtype = fsdp2_param_dtype(model, weight) if model is not None else None
        w = _gather_dtensor(weight, dtype)
        b = _gather_dtensor(bias, dtype) if is_dtensor(bias) else bias
        return w, b
    if is_zero3_param(weight) or is_zero3_param(bias):
        # under no_grad (reference / old-policy passes) a trainable head is only read
        trainable = [p for p in (weight, bias) if p is not None and p.requires_grad]
        if trainable and torch.is_grad_enabled():
            raise ValueError(
                "the LM head is trainable (requires_grad=True) under DeepSpeed ZeRO-3: its "
                "gradient would bypass ZeRO-3's partitioned gradient reduction. Freeze it (LoRA / "
                "QLoRA leave it frozen), or use ZeRO-2 or FSDP2 (fsdp_version: 2)."
            )
        with gathered_zero3(weight, bias):
            # A copy: on leaving the block ZeRO-3 frees (or reuses) the gathered storage.
            w = weight.detach().clone()
            b = None if bias is None else bias.detach().clone()
        return w, b
    return weight, bias
