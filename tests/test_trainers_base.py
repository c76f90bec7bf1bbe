"""`trainers.base.FusedHeadMixin`: what the trainers share, on a stand-in TRL class.

Covers: the order of construction (the TRL version before TRL's `__init__`, the fused-head checks
after it, on `model` and on `ref_model` where there is one); `_lce_falls_back` (False for no
reason, True and one logged line per distinct reason); every trainer built on the mixin with
its own names and messages; the packing options checked on every assignment, after
construction too. The trainers' own tests check the same through TRL
(tests/test_trainers_grpo.py, tests/test_trainers_sft.py, tests/test_trainers_dpo.py, ...).

    python -m pytest tests/test_trainers_base.py -q
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import trl

from trainers import (
    DistillationTrainer,
    DPOTrainer,
    GRPOTrainer,
    KTOTrainer,
    RLOOTrainer,
    SFTTrainer,
)
from trainers.base import FusedHeadMixin, PackingOptionsMixin
from trainers.fused_forward import FusedForwardMixin
from trainers.sampling.on_policy import OnPolicySamplingMixin
from trainers.tiny import build_tiny_llama, build_tokenizer


class _StockTrainer:
    """Stands in for a TRL trainer: keeps the models and records that its __init__ ran."""

    def __init__(self, model, ref_model=None):
        self.model, self.ref_model = model, ref_model
        self.stock_init_ran = True


class _Trainer(FusedHeadMixin, _StockTrainer):
    _trl_name = "GRPOTrainer"
    _trl_fallback = "the stock method"
    _lce_logger = logging.getLogger("test_trainers_base")


class _PackingTrainer(PackingOptionsMixin, _StockTrainer):
    _trl_name = "DPOTrainer"
    _trl_fallback = "the stock method"
    _lce_logger = logging.getLogger("test_trainers_base")


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama(build_tokenizer(), hidden_size=32, num_layers=1)


def test_construction_order(model, monkeypatch):
    tr = _Trainer(model)
    assert tr.stock_init_ran and tr._lce_fallbacks_logged == set()
    # a model without an LM head, as the reference: refused after TRL's __init__ ran
    headless = torch.nn.Module()
    headless.config = model.config
    with pytest.raises(ValueError, match="output embeddings"):
        _Trainer(model, ref_model=headless)
    # another TRL: refused before TRL's __init__ (it would run on internals we do not know)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.setattr(_StockTrainer, "__init__", lambda *a, **k: pytest.fail("TRL init ran"))
    with pytest.raises(RuntimeError, match=r"trainers\.GRPOTrainer supports trl>=1\.16,<1\.17"):
        _Trainer(model)


def test_falls_back_logs_once_per_reason(model, caplog):
    tr = _Trainer(model)
    with caplog.at_level(logging.WARNING, logger="test_trainers_base"):
        assert tr._lce_falls_back(None) is False
        assert tr._lce_falls_back("reason a") is True
        assert tr._lce_falls_back("reason a") is True
        assert tr._lce_falls_back("reason b") is True
    assert tr._lce_fallbacks_logged == {"reason a", "reason b"}
    assert [r.getMessage() for r in caplog.records] == [
        "grpo_lce head not used (reason a); using the stock method.",
        "grpo_lce head not used (reason b); using the stock method.",
    ]


def test_every_trainer_uses_it():
    for cls, stock, fallback in ((GRPOTrainer, trl.GRPOTrainer, "TRL's own fused head"),
                                 (SFTTrainer, trl.SFTTrainer, "TRL's own compute_loss"),
                                 (RLOOTrainer, trl.RLOOTrainer, "TRL's own fused head"),
                                 (DPOTrainer, trl.DPOTrainer, "TRL's own fused head"),
                                 (KTOTrainer, trl.KTOTrainer, "TRL's own fused head"),
                                 (DistillationTrainer, trl.DistillationTrainer,
                                  "TRL's own chunked divergence")):
        # the fused-forward trainers (trainers.fused_forward) and distillation add the packing
        # options' mixin (and the fused forward's) in between; the on-policy ones (GRPO, RLOO,
        # distillation) put the sampling mixin (trainers.sampling.on_policy) first
        mixins = {GRPOTrainer: (), SFTTrainer: (), DistillationTrainer: (PackingOptionsMixin,)
                  }.get(cls, (FusedForwardMixin, PackingOptionsMixin)) + (FusedHeadMixin,)
        if cls in (GRPOTrainer, RLOOTrainer, DistillationTrainer):
            mixins = (OnPolicySamplingMixin, *mixins)
        assert cls.__mro__[1:2 + len(mixins)] == (*mixins, stock)
        assert (cls._trl_name, cls._trl_fallback) == (stock.__name__, fallback)
        assert cls._lce_logger.name == cls.__module__


def test_packing_options_are_checked_on_set(model):
    tr = _PackingTrainer(model, packing="TRUE", max_packed_tokens=64)
    assert tr.packing is True and tr.max_packed_tokens == 64
    tr.packing = "false"  # normalised on set, as at construction
    assert tr.packing is False
    tr.packing = "auto"
    for bad in ("bogus", 1, None):
        with pytest.raises(ValueError, match=re.escape(
                f"packing must be True, False or 'auto', got {bad!r}")):
            tr.packing = bad
    assert tr.packing == "auto"  # a refused value is not stored
    for bad in (0, -3, 2.0, True, "64"):
        with pytest.raises(ValueError, match=re.escape(
                f"max_packed_tokens must be a positive int or None, got {bad!r}")):
            tr.max_packed_tokens = bad
    assert tr.max_packed_tokens == 64
    tr.max_packed_tokens = None
    assert tr.max_packed_tokens is None
    with pytest.raises(ValueError, match="packing must be"):
        _PackingTrainer(model, packing="yes")
