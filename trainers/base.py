"""What the trainers (`trainers.GRPOTrainer`, `SFTTrainer`, `RLOOTrainer`, `DPOTrainer`,
`KTOTrainer`, `DistillationTrainer`) do the same way, written once: the checks at construction,
the one logged line when a call goes to TRL's own code, and the packing decision per model.

    class GRPOTrainer(FusedHeadMixin, trl.GRPOTrainer):
        _trl_name = "GRPOTrainer"                  # the TRL class stood in for
        _trl_fallback = "TRL's own fused head"     # what a fallback hands the call to
        _lce_logger = logger                       # the trainer module's logger

Construction (`FusedHeadMixin.__init__`, which a trainer calls after checking its own keyword
options), in this order: the TRL version (`trainers._version`: the subclasses override TRL
internals of one minor series, so TRL's `__init__` does not run under another one); TRL's own
`__init__`; then what the fused head needs of every model it will run (`model`, and `ref_model`
where the trainer has one: `trainers.head.check_fused_head`) and of the parallelism
(`check_parallelism`). Each refusal is a ValueError or RuntimeError naming the problem and the
fix.

Fallbacks: a trainer names why a call cannot use the fused head (its `_lce_fallback_reason`, or
None), and `_lce_falls_back(reason)` says whether to hand the call to TRL's own method, logging
each distinct reason once per trainer (the reasons seen: `_lce_fallbacks_logged`).

Packing: `packing` ("auto", True or False) and `max_packed_tokens` are `_Checked` attributes,
checked on every assignment (`trainer.packing = "bogus"` raises a ValueError naming the value
and the allowed ones). `PackingOptionsMixin` takes them as constructor keywords, checked before
TRL's `__init__` runs (DPO, KTO, RLOO, distillation; GRPO also reads them from its config).
`_lce_packing_for(model)` is the one packing decision per model
(`trainers.attention.PackingDecisions`), its note logged once per trainer
(`_lce_packing_note`); a trainer adds only its per-call vetoes. `_lce_settle_attention(model)`
makes the decision without a note, for sampling, before a decode step is captured;
`_lce_pack_if_shorter` says whether a batch packs only where packing removes tokens ("auto").
"""

from __future__ import annotations

import logging

from ._version import check_trl_version
from .attention import PackingDecisions
from .config import check_max_packed_tokens, normalize_packing
from .head import check_fused_head, check_parallelism


class _Checked:
    """An instance attribute whose every assignment goes through `check(value, name)`, which
    returns the value to store or raises a ValueError naming it; read before any assignment, an
    AttributeError as for a plain attribute."""

    def __init__(self, check):
        self.check = check

    def __set_name__(self, owner, name):
        self.name, self.slot = name, f"_lce_option_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(
                f"{type(obj).__name__!r} object has no attribute {self.name!r}") from None

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = self.check(value, self.name)


def _checked_max_packed_tokens(value, name: str):
    check_max_packed_tokens(value, name)
    return value


class FusedHeadMixin:
    """Mixed in before a TRL trainer class; see the module docstring for the class attributes."""

    _trl_name: str
    _trl_fallback: str
    _lce_logger: logging.Logger

    # the packing options of the trainers that have them (all but SFT), checked on every set
    packing = _Checked(normalize_packing)
    max_packed_tokens = _Checked(_checked_max_packed_tokens)

    def __init__(self, *args, **kwargs):
        check_trl_version(self._trl_name)
        # before TRL's __init__: DPO / KTO precompute reference log-probs inside it
        self._lce_fallbacks_logged: set[str] = set()
        self._lce_packing_logged: set[str] = set()
        self._lce_packing_decisions = PackingDecisions()
        super().__init__(*args, **kwargs)
        for model in (self.model, getattr(self, "ref_model", None)):
            if model is not None:
                check_fused_head(model)
        check_parallelism(self)

    def _lce_warn_once(self, seen: set[str], key: str, message: str) -> None:
        """Log `message` unless `key` is already in `seen` (one line per distinct key)."""
        if key not in seen:
            seen.add(key)
            self._lce_logger.warning(message)

    def _lce_falls_back(self, reason: str | None) -> bool:
        """Whether this call goes to TRL's own method (`reason` is not None), logged once per
        reason."""
        if reason is None:
            return False
        self._lce_warn_once(self._lce_fallbacks_logged, reason,
                            f"grpo_lce head not used ({reason}); using {self._trl_fallback}.")
        return True

    def _lce_packing_note(self, message: str) -> None:
        self._lce_warn_once(self._lce_packing_logged, message, message)

    def _lce_packing_for(self, model) -> str | None:
        """How `model`'s passes pack under `self.packing` ("varlen", "block", "sdpa_varlen",
        "dense"), or None for padded: the decision kept for this model, its note logged once."""
        kind, note = self._lce_packing_decisions.decide(model, self.packing)
        if note is not None:
            self._lce_packing_note(note)
        return kind

    @property
    def _lce_pack_if_shorter(self) -> bool:
        """Whether a batch packs only where packing removes tokens (`trainers.packing.
        plan_target_packs`'s `if_shorter`): under "auto"; True packs every batch that packs."""
        return self.packing == "auto"

    def _lce_settle_attention(self, model) -> None:
        """Make `model`'s packing decision now, logging nothing: it may switch the attention
        implementation (sdpa to `trainers.attention.IMPL`), which a captured decode step
        depends on, so sampling calls this before its first capture."""
        self._lce_packing_decisions.decide(model, getattr(self, "packing", False))


class PackingOptionsMixin(FusedHeadMixin):
    """The `packing` and `max_packed_tokens` keywords (module docstring).

        packing: "auto" (default), True or False — padding-free backbone passes (the trainer's
            module docstring says which); "auto" packs a batch that has padding to remove,
            under attention that packs without a dense mask (`trainers.attention`), True
            every batch that packs; also settable later as the attribute `trainer.packing`
            (checked on set, as `max_packed_tokens` is).
        max_packed_tokens: tokens per packed forward; None (default) = the padded call's
            B · L, so a pack never outgrows the batch it replaces.
    """

    def __init__(self, *args, packing: bool | str = "auto", max_packed_tokens: int | None = None,
                 **kwargs):
        check_max_packed_tokens(max_packed_tokens)
        # set before TRL's __init__: DPO / KTO precompute reference log-probs inside it
        self.packing = normalize_packing(packing)
        self.max_packed_tokens = max_packed_tokens
        super().__init__(*args, **kwargs)
