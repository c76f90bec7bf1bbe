"""trainers.sampling.serve: which sampler serves a generation call, and the fallback lines.

Covers the order for each `choice` ("auto": loop, compiled, TRL; "loop": loop, TRL;
"compiled": compiled, TRL; "trl"), every way the decode loop is passed over (unsupported,
turned off, declined, raised, malformed result, its module absent) with exactly one logged line
per reason naming where the call goes, the compiled sampler's completions trimmed at the first
EOS as TRL does, the call counts (`served`) and metrics, and bad choices. The samplers are
the test doubles of tests/_fake_loop.py on a tiny CPU Llama; the real FastSampler is
tests/test_generation.py's subject.

    python -m pytest tests/test_sampling_serve.py -q
"""

from __future__ import annotations

import logging

import pytest
import torch
from _fake_loop import FakeCompiled, FakeDecodeLoop
from _tiny_models import lora_tiny_llama
from transformers import GenerationConfig

from trainers.generation import trim_after_eos
from trainers.sampling.serve import Samplers
from trainers.tiny import build_tokenizer

NEW = 6


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return lora_tiny_llama(tok)


def _config(tok):
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                            eos_token_id=[tok.eos_token_id], disable_compile=True)


def _batch(tok):
    enc = tok(["7+5=", "hello there", "a"], return_tensors="pt", padding=True,
              padding_side="left")
    return enc.input_ids, enc.attention_mask


def _eager_completions(model, tok):
    ids, mask = _batch(tok)
    with torch.no_grad():
        seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(tok))
    return trim_after_eos(seq[:, ids.size(1):], [tok.eos_token_id])


def _serve(s, model, tok):
    ids, mask = _batch(tok)
    return s.serve(model, ids, mask, _config(tok), eos_token_ids=[tok.eos_token_id])


def _lines(caplog, text="decode loop not used"):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_auto_prefers_the_loop(tok, model):
    loop, compiled = FakeDecodeLoop(), FakeCompiled()
    s = Samplers("auto", loop=loop, compiled=compiled)
    sample = _serve(s, model, tok)
    assert sample.sampler == "loop"
    assert sample.token_ids == loop.returned[0].token_ids == _eager_completions(model, tok)
    assert sample.logprobs == loop.returned[0].logprobs
    assert all(len(lp) == len(ids) for lp, ids in zip(sample.logprobs, sample.token_ids))
    assert compiled.asked == 0
    assert s.served == {"loop": 1, "compiled": 0, "trl": 0}
    m = s.metrics()
    assert (m["fast_generation/loop_calls"], m["fast_generation/captures"]) == (1.0, 1.0)


@pytest.mark.parametrize("how", ["unsupported", "turned_off", "raises", "malformed", "absent"])
def test_loop_passed_over_once_per_reason_then_compiled(tok, model, caplog, how):
    """Three calls; each way the loop cannot serve logs one line, once, with the reason (ours
    names FastSampler; a loop that turns itself off logs its own); the compiled sampler serves
    every call the loop does not."""
    kw = {"unsupported": {"unsupported": "Gemma2 is not a supported family"},
          "turned_off": {"decline_after": 1},
          "raises": {"raises": RuntimeError("capture failed\nsecond line")},
          "malformed": {"drop_last_logprob": True},
          "absent": None}[how]
    if kw is None:
        def factory(devices):
            raise ModuleNotFoundError("No module named 'trainers.sampling.loop'")
        loop, s_kw = None, {"loop_factory": factory}
    else:
        loop = FakeDecodeLoop(**kw)
        s_kw = {"loop": loop}
    compiled = FakeCompiled()
    s = Samplers("auto", compiled=compiled, **s_kw)
    with caplog.at_level(logging.WARNING):
        samples = [_serve(s, model, tok) for _ in range(3)]
    by = [x.sampler for x in samples]
    expect_reason = {"unsupported": "Gemma2 is not a supported family",
                     "turned_off": "the fake loop turned itself off",
                     "raises": "RuntimeError: capture failed",
                     "malformed": "row 0 has",
                     "absent": "trainers.sampling.loop unavailable (ModuleNotFoundError"}[how]
    lines = _lines(caplog, expect_reason)
    assert len(lines) == 1, lines  # one line in all, the loop's own or ours
    if how != "turned_off":  # ours names where the call goes
        assert "decode loop not used" in lines[0] and "FastSampler" in lines[0]
    if how == "turned_off":  # the first call is the loop's, then it declines
        assert by == ["loop", "compiled", "compiled"]
    else:
        assert by == ["compiled"] * 3
    ref = _eager_completions(model, tok)
    assert all(x.token_ids == ref for x in samples)
    assert s.served["loop"] + s.served["compiled"] == 3 and s.served["trl"] == 0
    if how in ("raises", "malformed"):  # a broken loop is not asked again
        assert loop.asked == 1


def test_loop_choice_skips_the_compiled_sampler(tok, model, caplog):
    compiled = FakeCompiled()
    s = Samplers("loop", loop=FakeDecodeLoop(unsupported="no static cache"), compiled=compiled)
    with caplog.at_level(logging.WARNING):
        assert _serve(s, model, tok) is None and _serve(s, model, tok) is None
    (line,) = _lines(caplog)
    assert "no static cache" in line and "TRL's generate" in line
    assert compiled.asked == 0 and s.served == {"loop": 0, "compiled": 0, "trl": 2}


def test_compiled_choice_never_builds_the_loop(tok, model):
    def factory(devices):
        raise AssertionError("the loop must not be built")

    s = Samplers("compiled", loop_factory=factory, compiled=FakeCompiled())
    sample = _serve(s, model, tok)
    assert sample.sampler == "compiled" and sample.logprobs is None
    assert sample.token_ids == _eager_completions(model, tok)
    assert s._loop is None and s.loop_off is None


def test_compiled_declining_goes_to_trl(tok, model, caplog):
    s = Samplers("auto", loop=FakeDecodeLoop(unsupported="x"), compiled=FakeCompiled(decline=True))
    with caplog.at_level(logging.WARNING):
        assert _serve(s, model, tok) is None
    assert s.served == {"loop": 0, "compiled": 0, "trl": 1}
    assert len(_lines(caplog)) == 1


def test_off_compiled_sampler_named_in_the_line(tok, model, caplog):
    """With FastSampler already off, the loop's fallback line names TRL's generate."""
    compiled = FakeCompiled()
    compiled.disable("it needs a CUDA device")
    s = Samplers("auto", loop=FakeDecodeLoop(unsupported="y"), compiled=compiled)
    with caplog.at_level(logging.WARNING):
        assert _serve(s, model, tok) is None
    (line,) = _lines(caplog)
    assert "TRL's generate" in line


def test_trl_choice_runs_nothing(tok, model):
    loop, compiled = FakeDecodeLoop(), FakeCompiled()
    s = Samplers("trl", loop=loop, compiled=compiled)
    assert _serve(s, model, tok) is None
    assert (loop.asked, compiled.asked, s.served["trl"]) == (0, 0, 1)


def test_compiled_completions_are_trimmed_at_the_first_eos(tok, model):
    """FastSampler returns the padded batch (prompt + completions); what is served is each
    completion up to and including its first EOS, as TRL keeps it."""
    ids, mask = _batch(tok)
    eos = tok.eos_token_id
    tail = torch.tensor([[5, eos, 6, 7], [8, 9, 10, 11], [eos, eos, 3, 3]])

    class Padded(FakeCompiled):
        def generate(self, model, input_ids, attention_mask, generation_config):
            self.stats.calls += 1
            return torch.cat([input_ids, tail], dim=1)

    s = Samplers("compiled", compiled=Padded())
    sample = s.serve(model, ids, mask, _config(tok), eos_token_ids=[eos])
    assert sample.token_ids == [[5, eos], [8, 9, 10, 11], [eos]]


def test_disable_turns_both_off(tok, model, caplog):
    loop, compiled = FakeDecodeLoop(), FakeCompiled()
    s = Samplers("auto", loop=loop, compiled=compiled)
    s.disable("FSDP / DeepSpeed shard the parameters")
    with caplog.at_level(logging.WARNING):
        assert _serve(s, model, tok) is None
    assert loop.asked == 0 and compiled.disabled_reason.startswith("FSDP")
    assert _lines(caplog) == []  # FastSampler's own line says it (tests/test_generation.py)


def test_bad_choice_is_refused():
    with pytest.raises(ValueError, match="sampler must be one of .* got 'fast'"):
        Samplers("fast")
