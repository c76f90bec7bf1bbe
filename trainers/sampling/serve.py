"""Which sampler serves one on-policy generation call: the one place that decides.

    samplers = Samplers("auto")          # or "loop", "compiled", "trl"
    sample = samplers.serve(model, input_ids, attention_mask, generation_config,
                            eos_token_ids=[...])
    sample is None                       -> the caller samples with TRL's own generate
    sample.token_ids  list[list[int]]    each completion up to and including its first EOS
    sample.logprobs   list[list[float]]  the sampler's fp32 log-prob of each token under the
                      or None            distribution it was drawn from (our loop only)
    sample.sampler    "loop" | "compiled"

`input_ids` / `attention_mask` are TRL's left-padded prompt batch (B, P) on the model's device.

The order, for `choice`:

    "auto"      our decode loop (`trainers.sampling.loop.DecodeLoop`), then today's compiled
                `trainers.generation.FastSampler`, then TRL's generate
    "loop"      our decode loop, then TRL's generate
    "compiled"  FastSampler, then TRL's generate
    "trl"       TRL's generate

A sampler is passed over when it cannot serve: the decode loop when its module is absent or
fails to import, says the model or generation config is unsupported (`unsupported_reason`), has
turned itself off (`disabled_reason`), declines a call (returns None), raises, or returns
completions that do not fit the batch; FastSampler when it is off or declines a call. One
logged line per distinct reason: the decode loop and FastSampler log their own when they
decline a call or turn themselves off; this module logs the others (the loop absent, an
unsupported model or config, an exception, a malformed batch), naming the sampler the call goes
to. A loop that raised or returned a malformed batch is not asked again for the rest of the
run.

`served` counts the calls each sampler served ("loop", "compiled", "trl"), so a caller can
assert which path ran; `metrics()` gives them with the samplers' one-time costs.

The decode loop is imported when first needed, so this module (and every trainer) works
without it.
"""

from __future__ import annotations

import dataclasses

from transformers.utils import logging

from ..config import SAMPLER_CHOICES
from ..generation import FastSampler, trim_after_eos

logger = logging.get_logger(__name__)

_ORDER = {"auto": ("loop", "compiled"), "loop": ("loop",), "compiled": ("compiled",),
          "trl": ()}


@dataclasses.dataclass
class Sample:
    token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    sampler: str


def _new_decode_loop(devices):
    from .loop import DecodeLoop  # the decode loop's own module; may be absent

    return DecodeLoop(devices=tuple(devices))


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def malformed_reason(completions, batch: int) -> str | None:
    """Why the loop's `Completions` cannot be a batch of `batch` completions, or None: one
    token list per row, and one log-prob per token."""
    ids, logps = completions.token_ids, completions.logprobs
    if len(ids) != batch or len(logps) != batch:
        return (f"it returned {len(ids)} completions and {len(logps)} log-prob rows for a batch "
                f"of {batch}")
    for b, (row, lp) in enumerate(zip(ids, logps)):
        if len(row) != len(lp):
            return f"row {b} has {len(row)} tokens but {len(lp)} log-probs"
    return None


class Samplers:
    """The samplers of one trainer and the order they are tried in (module docstring).

    `loop` and `compiled` may be given (tests pass stand-ins); otherwise the loop is built on
    first use by `loop_factory(devices)` (default: `DecodeLoop(devices=devices)`, imported
    then), and `compiled` is a `FastSampler(devices=devices)`.
    """

    def __init__(self, choice: str = "auto", *, loop=None, compiled=None, loop_factory=None,
                 devices=("cuda",)):
        if choice not in SAMPLER_CHOICES:
            raise ValueError(f"sampler must be one of {SAMPLER_CHOICES}, got {choice!r}")
        self.choice = choice
        self.devices = tuple(devices)
        self._loop = loop
        self._loop_factory = loop_factory or _new_decode_loop
        self.compiled = compiled if compiled is not None else FastSampler(devices=devices)
        self.loop_off: str | None = None  # our own verdict: the loop is not asked again
        self.served = {"loop": 0, "compiled": 0, "trl": 0}
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ the samplers

    @property
    def loop(self):
        """The decode loop, built on first use; None when it cannot be (`loop_off` says why)."""
        if self._loop is None and self.loop_off is None:
            try:
                self._loop = self._loop_factory(self.devices)
            except Exception as exc:  # noqa: BLE001 - an absent or broken loop: fall back
                self.loop_off = f"trainers.sampling.loop unavailable ({_first_line(exc)})"
        return self._loop

    @loop.setter
    def loop(self, value):
        self._loop, self.loop_off = value, None

    def disable(self, reason: str) -> None:
        """Turn the fast samplers off for the rest of the run (TRL's generate serves all), with
        FastSampler's one logged line."""
        if self.loop_off is None:
            self.loop_off = reason
            self._logged.add(reason)
        self.compiled.disable(reason)

    def _next_after_loop(self) -> str:
        if "compiled" in _ORDER[self.choice] and self.compiled.disabled_reason is None:
            return "trainers.generation.FastSampler"
        return "TRL's generate"

    def _pass_over_loop(self, reason: str) -> None:
        """One logged line per distinct reason."""
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning(f"grpo_lce decode loop not used ({reason}); sampling with "
                           f"{self._next_after_loop()}.")

    # ------------------------------------------------------------------ one call

    def serve(self, model, input_ids, attention_mask, generation_config, *,
              eos_token_ids) -> Sample | None:
        for name in _ORDER[self.choice]:
            if name == "loop":
                sample = self._serve_loop(model, input_ids, attention_mask, generation_config)
            else:
                sample = self._serve_compiled(model, input_ids, attention_mask,
                                              generation_config, eos_token_ids)
            if sample is not None:
                self.served[name] += 1
                return sample
        self.served["trl"] += 1
        return None

    def _serve_loop(self, model, input_ids, attention_mask, generation_config):
        loop = self.loop
        if self.loop_off is not None:
            self._pass_over_loop(self.loop_off)
            return None
        if loop.disabled_reason is not None:
            self._logged.add(loop.disabled_reason)  # the loop logged it when it turned off
            return None
        reason = loop.unsupported_reason(model, generation_config)
        if reason is not None:
            self._pass_over_loop(reason)
            return None
        try:
            out = loop.generate(model, input_ids, attention_mask, generation_config)
        except Exception as exc:  # noqa: BLE001 - the loop's failure falls back, with its reason
            self.loop_off = _first_line(exc)
            self._pass_over_loop(self.loop_off)
            return None
        if out is None:  # the loop logs why it declines or turns off (its contract)
            self._logged.add(loop.disabled_reason or "it declined a call")
            return None
        bad = malformed_reason(out, input_ids.size(0))
        if bad is not None:
            self.loop_off = f"malformed completions: {bad}"
            self._pass_over_loop(self.loop_off)
            return None
        return Sample([list(map(int, r)) for r in out.token_ids],
                      [list(map(float, r)) for r in out.logprobs], "loop")

    def _serve_compiled(self, model, input_ids, attention_mask, generation_config,
                        eos_token_ids):
        if self.compiled.disabled_reason is not None:
            return None
        sequences = self.compiled.generate(model, input_ids, attention_mask, generation_config)
        if sequences is None:
            return None
        return Sample(trim_after_eos(sequences[:, input_ids.size(1):], eos_token_ids), None,
                      "compiled")

    # ------------------------------------------------------------------ reporting

    def metrics(self) -> dict[str, float]:
        """`fast_generation/*` metrics once a fast sampler has served a call or compiled: the
        calls each sampler served so far, and the one-time costs (the loop's captures,
        FastSampler's compiles) with their wall time; {} before that."""
        st = self.compiled.stats
        if not (self.served["loop"] or self.served["compiled"] or st.compiles):
            return {}
        out = {f"fast_generation/{k}_calls": float(v) for k, v in self.served.items()}
        if self._loop is not None:
            out["fast_generation/captures"] = float(self._loop.stats.captures)
            out["fast_generation/capture_s"] = float(self._loop.stats.capture_s)
        if st.calls or st.compiles:
            out["fast_generation/compiles"] = float(st.compiles)
            out["fast_generation/compile_s"] = float(st.compile_s)
        return out
