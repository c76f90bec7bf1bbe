"""Helpers the trainer tests share: build a trainer on a copy of a tiny model, run one
`compute_loss` + backward or a short `train()`, and compare ours against stock TRL (loss,
gradients, logged metrics, training logs); and the ragged prompt + completion batch that the
GRPO and RLOO tests (single-process and DDP) score; and `fused_head_ran`, which every test
comparing ours with TRL or fp64 runs ours inside, so that a silent fallback to TRL's code fails
it (tests/_force_fallback.py forces one, to check that they do)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from _tolerance import _log, assert_grads_vs_fp64, assert_loss_vs_fp64, in_fp64


def assert_close(ours, ref, *, rtol=0.0, atol=0.0, what=""):
    """max |ours − ref| <= atol + rtol · max |ref|, with the worst error in the message."""
    ours, ref = torch.as_tensor(ours).double(), torch.as_tensor(ref).double()
    err = (ours - ref).abs().max().item() if ref.numel() else 0.0
    bound = atol + rtol * (ref.abs().max().item() if ref.numel() else 0.0)
    _log(what, err, bound)
    assert err <= bound, f"{what}: max err {err:.3e} > {bound:.3e}"


@contextlib.contextmanager
def fused_head_ran(*trainers, min_calls: int = 1):
    """Asserts, on leaving the block without an error, that grpo_lce's head ran in it: at least
    `min_calls` calls decided a Path (`grpo_lce._dispatch.recording()`; TRL's own code never
    calls grpo_lce), and none of `trainers` ever logged a fallback to TRL's code
    (`FusedHeadMixin._lce_fallbacks_logged` empty, construction included). Yields the Record.
    Inside `trl_head_in_fp64` nothing is asserted: that step is TRL's head by design (the fp64
    truth the fused steps are measured against)."""
    # imported here: the DDP worker imports this module before it sets TRITON_INTERPRET
    from grpo_lce._dispatch import recording

    with recording() as rec:
        yield rec
    if any(getattr(tr, "_lce_fp64_truth", False) for tr in trainers):
        return
    assert len(rec.paths) >= min_calls, (
        f"grpo_lce decided {len(rec.paths)} calls in the block (expected >= {min_calls}): "
        "the trainer fell back to TRL's code without logging it")
    for tr in trainers:
        assert tr._lce_fallbacks_logged == set(), (
            f"{type(tr).__name__} fell back to TRL's code: {sorted(tr._lce_fallbacks_logged)}")


def fused_if_ours(tr):
    """`fused_head_ran(tr)` for one of our trainers (a `FusedHeadMixin`), a plain block for a
    stock TRL one: for loops and helpers that run both."""
    if hasattr(tr, "_lce_fallbacks_logged"):
        return fused_head_ran(tr)
    return contextlib.nullcontext()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_step(tr, inputs, **kwargs):
    """(loss, grads, logged metrics) of one `compute_loss` + backward on `inputs`."""
    tr.model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(tr.model, dict(inputs), **kwargs)
    loss.backward()
    return loss.detach(), grads(tr.model), {k: list(v) for k, v in tr._metrics["train"].items()}


def randomize_adapter(model, *, seed: int, adapter: str = "default") -> None:
    """Random lora_B weights of `adapter` (the same for the same seed), so that a policy whose
    reference is the initial adapter or no adapter differs from it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def ragged_ids_and_mask(tok, P: int, C: int, *, generator=None):
    """4 rows of prompt + completion ids (4, P + C) and their mask, laid out as TRL's
    `_generate_and_score_completions` lays them out: prompts padded on the left (rows 0 and 3),
    completions on the right (rows 1 and 2), pad ids under the mask's zeros. The ids are drawn
    from `generator` (default: a fresh one seeded 123)."""
    g = torch.Generator().manual_seed(123) if generator is None else generator
    ids = torch.randint(8, len(tok), (4, P + C), generator=g)
    mask = torch.ones(4, P + C, dtype=torch.long)
    mask[0, :2] = 0  # short prompt
    mask[1, -4:] = 0  # short completion
    mask[2, -1:] = 0
    mask[3, :1] = 0
    ids[mask == 0] = tok.pad_token_id
    return ids, mask


class BackboneCalls:
    """Records the (batch, length) of every call of `backbone` (a model's `base_model`) inside
    the block: (1, T) for a packed pass, (rows, L) for a padded one."""

    def __init__(self, backbone):
        self.backbone, self.shapes = backbone, []

    def __enter__(self):
        def hook(_m, _args, kwargs):
            self.shapes.append(tuple(kwargs["input_ids"].shape))

        self._handle = self.backbone.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def build_trainer(cls, model, **kwargs):
    """`cls(model=<a copy of model>, **kwargs)` (a `ref_model` among kwargs copied too), whose LoRA
    adapter then gets `randomize_adapter(seed=3)`: the same weights in every trainer built here,
    and a policy that differs from its reference (the initial adapter or none)."""
    if kwargs.get("ref_model") is not None:
        kwargs["ref_model"] = copy.deepcopy(kwargs["ref_model"])
    tr = cls(model=copy.deepcopy(model), **kwargs)
    randomize_adapter(tr.model, seed=3)
    return tr


def build_pair(stock_cls, ours_cls, model, make_kwargs) -> list:
    """[stock, ours] in train mode, each `build_trainer(cls, model, **make_kwargs())`: the
    keyword arguments (config, dataset) made afresh for each trainer, which may change them."""
    out = []
    for cls in (stock_cls, ours_cls):
        tr = build_trainer(cls, model, **make_kwargs())
        tr.model.train()
        out.append(tr)
    return out


def train_logs(cls, model, **kwargs) -> list[dict]:
    """The per-step logs (the entries with a loss) of `build_trainer(cls, model, **kwargs)`'s
    `train()`. Call it once per trainer, one after the other: the trainer's `__init__` reseeds
    the global RNG (`set_seed(args.seed)`), so each `train()` starts from the same random stream.
    Ours (a `FusedHeadMixin`, unlike TRL's) trains inside `fused_head_ran(tr)`."""
    tr = build_trainer(cls, model, **kwargs)
    with fused_if_ours(tr):
        tr.train()
    return [h for h in tr.state.log_history if "loss" in h]


def _models(tr) -> dict:
    """`tr`'s model and its reference or teacher model, where it has one, by id."""
    return {id(m): m for m in (tr.model, getattr(tr, "ref_model", None),
                               getattr(tr, "teacher_model", None)) if m is not None}


@contextlib.contextmanager
def trl_head_in_fp64(tr):
    """`tr`'s models (and reference or teacher model) in fp64, and every head call of our
    trainer handed to TRL's own method (grpo_lce takes fp32 / bf16 / fp16 only): a step inside
    is the fp64 truth of the same step."""
    models = _models(tr)
    tr._lce_falls_back = lambda reason: True  # shadows the method on this instance only
    tr._lce_fp64_truth = True  # `fused_head_ran` asserts nothing on this step
    try:
        with in_fp64(*models.values()):
            yield
    finally:
        del tr._lce_falls_back, tr._lce_fp64_truth


def fp64_step(tr, inputs, **kwargs):
    """`loss_step` of `tr` with its model (and reference or teacher model) in fp64: the truth
    that `assert_same_step` measures both fp32 steps against."""
    models = _models(tr)
    # this step's metrics and token count are not part of the trainer's history
    logged = copy.deepcopy(tr._metrics), getattr(tr, "_total_train_tokens", None)
    try:
        with in_fp64(*models.values()):
            return loss_step(tr, inputs, **kwargs)
    finally:
        tr._metrics, tokens = logged
        if tokens is not None:
            tr._total_train_tokens = tokens


def assert_same_step(stock_step, ours_step, ref_step, *, metric_rel, metric_abs, lora_only=True,
                     loss_terms=64):
    """Loss and gradients of two fp32 `loss_step` results against stock's `fp64_step`
    (`ref_step`), each within K_REORDERED of stock's own error (tests/_tolerance.py; the loss
    a mean of at most `loss_terms` terms, the tokens or pairs of these tiny batches), the same
    parameters, and every logged metric."""
    (loss_s, g_s, m_s), (loss_o, g_o, m_o), (loss_r, g_r, _) = stock_step, ours_step, ref_step
    assert_loss_vs_fp64(loss_o, loss_s, loss_r, n_terms=loss_terms)
    assert g_s.keys() == g_o.keys() and len(g_s) > 0
    if lora_only:
        assert all("lora_" in n for n in g_s), [n for n in g_s if "lora_" not in n]
    assert_grads_vs_fp64(g_o, g_s, g_r)
    assert m_s.keys() == m_o.keys()
    for k in m_s:
        assert m_o[k] == pytest.approx(m_s[k], rel=metric_rel, abs=metric_abs), (k, m_o[k], m_s[k])


def assert_same_logs(logs_s, logs_o, *, steps, rel, abs_, ours_only=()):
    """The per-step training logs (every key but the timings) of two `train()` runs; keys in
    `ours_only` (our own metrics, e.g. "timing/generation_s") may appear in ours alone."""
    assert len(logs_s) == len(logs_o) == steps
    for step, (s, o) in enumerate(zip(logs_s, logs_o, strict=True), start=1):
        assert o.keys() - set(ours_only) == s.keys(), (step, o.keys() ^ s.keys())
        for k in s.keys() - {"step_time"}:
            assert o[k] == pytest.approx(s[k], rel=rel, abs=abs_), (step, k, o[k], s[k])
