"""trainers.sampling.on_policy: our samplers inside trainers.GRPOTrainer, RLOOTrainer and
DistillationTrainer.

Covers, for each trainer: a 2-step `train()` whose every generation is served by the decode
loop (a test double, tests/_fake_loop.py: HF eager `generate` with its log-probs), the
completions TRL trains on being exactly those the loop returned, the served counts and the
`timing/generation_s` / `fast_generation/*` metrics in the logs; greedy completions of our
path equal to TRL's own `_generate_single_turn` on the same prompts, each path seen running;
the `sampler` / `fast_generation` options choosing the path (keywords, config fields, later
attribute changes) and their validation; the loop's fallback line inside a trainer; the
packing decision made before sampling, once, without a logged note.

    python -m pytest tests/test_sampling_on_policy.py -q
"""

from __future__ import annotations

import logging
import math

import pytest
import trl
from _fake_loop import FakeCompiled, FakeDecodeLoop
from _tiny_models import lora_tiny_llama, soft_head_model
from datasets import Dataset

from trainers import DistillationTrainer, GRPOConfig, GRPOTrainer, RLOOTrainer
from trainers.tiny import build_tokenizer

NEW = 6
KINDS = ("grpo", "rloo", "distillation")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _reward(completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


def _common(tmp_path, **over):
    kw = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True, "bf16": False,
              "per_device_train_batch_size": 4, "max_completion_length": NEW, "logging_steps": 1,
              "save_strategy": "no", "seed": 0, "max_steps": 2, "learning_rate": 0.05}
    kw.update(over)
    return kw


def _trainer(kind, tok, tmp_path, *, greedy=False, config=None, **kw):
    """A trainer of `kind` on tiny CPU models whose samplers are the test doubles: the fake
    decode loop first, a fake compiled sampler after it."""
    ds = Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z"] * 4})
    gen = {"generation_kwargs": {"do_sample": False}} if greedy else {}
    if kind == "grpo":
        args = config or trl.GRPOConfig(**_common(tmp_path, num_generations=2, beta=0.0, **gen))
        tr = GRPOTrainer(model=lora_tiny_llama(tok), args=args, train_dataset=ds,
                         processing_class=tok, reward_funcs=_reward, **kw)
    elif kind == "rloo":
        args = trl.RLOOConfig(**_common(tmp_path, num_generations=2, **gen))
        tr = RLOOTrainer(model=lora_tiny_llama(tok), args=args, train_dataset=ds,
                         processing_class=tok, reward_funcs=_reward, **kw)
    else:
        args = trl.DistillationConfig(**_common(tmp_path, gradient_checkpointing=False, **gen))
        tr = DistillationTrainer(
            model=soft_head_model(tok, tied=True, peft=True),
            teacher_model=soft_head_model(tok, tied=False, peft=False, hidden=96, seed=7),
            args=args, train_dataset=ds, processing_class=tok, **kw)
    tr._lce_samplers.loop = FakeDecodeLoop()
    tr._lce_sampler = FakeCompiled()
    return tr


def _record_completions(tr) -> list:
    """Wrap the trainer's `_generate` (every TRL trainer returns completion_ids second) to
    record what TRL goes on to train on."""
    seen, generate = [], tr._generate

    def recording(prompts):
        out = generate(prompts)
        seen.append(out[1])
        return out

    tr._generate = recording
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_train_uses_the_loops_completions(kind, tok, tmp_path):
    tr = _trainer(kind, tok, tmp_path)
    seen = _record_completions(tr)
    tr.train()
    loop = tr._lce_samplers.loop
    # our path ran, every time, and nothing fell back
    assert loop.stats.calls == len(seen) >= 1
    assert tr._lce_samplers.served == {"loop": len(seen), "compiled": 0, "trl": 0}
    assert tr._lce_sampler.asked == 0
    assert [r.token_ids for r in loop.returned] == seen
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["timing/generation_s"] > 0 and h["fast_generation/loop_calls"] >= 1
               and h["fast_generation/trl_calls"] == 0 for h in logs)


def _single_turn(tr, prompt_ids):
    kind_args = {GRPOTrainer: (None, {}, 2), RLOOTrainer: (None, {}),
                 DistillationTrainer: (None, {})}[type(tr)]
    out = tr._generate_single_turn(prompt_ids, *kind_args)
    return out[0] if isinstance(tr, GRPOTrainer) else out


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_completions_equal_trls_path(kind, tok, tmp_path):
    tr = _trainer(kind, tok, tmp_path, greedy=True)
    prompt_ids = [tok(t).input_ids for t in ("7+5=", "hello there", "a", "x" * 30)]
    ours = _single_turn(tr, prompt_ids)
    assert tr._lce_samplers.served == {"loop": 1, "compiled": 0, "trl": 0}
    tr.sampler = "trl"
    trls = _single_turn(tr, prompt_ids)
    assert tr._lce_samplers.served["loop"] == 1 and tr._lce_samplers.loop.stats.calls == 1
    assert ours == trls
    assert any(len(c) > 1 for c in ours)


@pytest.mark.parametrize("options,served", [
    ({}, "loop"),
    ({"sampler": "loop"}, "loop"),
    ({"sampler": "compiled"}, "compiled"),
    ({"sampler": "trl"}, None),
    ({"fast_generation": False}, None),
])
def test_options_choose_the_path(tok, tmp_path, options, served):
    tr = _trainer("rloo", tok, tmp_path, **options)
    if not options:  # a stock TRL config: the defaults
        assert (tr.fast_generation, tr.sampler) == (True, "auto")
    out = _single_turn(tr, [tok("1+1=").input_ids, tok("abc").input_ids])
    assert len(out) == 2
    counts = tr._lce_samplers.served
    if served is None:  # TRL's own method: our samplers were not even asked
        assert counts == {"loop": 0, "compiled": 0, "trl": 0}
        assert tr._lce_samplers.loop.asked == tr._lce_sampler.asked == 0
    else:
        assert counts[served] == 1 and sum(counts.values()) == 1


def test_loop_fallback_line_inside_a_trainer(tok, tmp_path, caplog):
    tr = _trainer("distillation", tok, tmp_path)
    tr._lce_samplers.loop = FakeDecodeLoop(unsupported="this family is not supported")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _single_turn(tr, [tok("abc").input_ids])
    lines = [r.getMessage() for r in caplog.records if "decode loop not used" in r.getMessage()]
    assert lines == [("grpo_lce decode loop not used (this family is not supported); sampling "
                     "with trainers.generation.FastSampler.")]
    assert tr._lce_samplers.served == {"loop": 0, "compiled": 2, "trl": 0}


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_settles_attention_without_a_note(kind, tok, tmp_path, monkeypatch, caplog):
    # Before its first sample, a trainer makes the policy's packing decision (which may switch
    # the attention implementation a captured decode step reads): once, whatever the number of
    # samples, and without logging the decision's note (here: sdpa on CPU stays padded), which
    # is the log-prob passes' to give.
    from trainers import attention

    decided = []
    rule = attention.choose_packing
    monkeypatch.setattr(attention, "choose_packing",
                        lambda model, packing: decided.append(packing) or rule(model, packing))
    tr = _trainer(kind, tok, tmp_path)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _single_turn(tr, [tok("abc").input_ids])
    assert tr._lce_samplers.served["loop"] == 2
    assert decided == ["auto"]
    assert [r.getMessage() for r in caplog.records if "pack" in r.getMessage()] == []


def test_grpo_config_fields(tok, tmp_path):
    from trl import TrlParser

    (cfg,) = TrlParser(GRPOConfig).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--sampler", "compiled",
         "--sampler_importance_sampling_correction", "false"])
    assert (cfg.sampler, cfg.sampler_importance_sampling_correction) == ("compiled", False)
    args = GRPOConfig(**_common(tmp_path, num_generations=2, beta=0.0), sampler="loop")
    tr = _trainer("grpo", tok, tmp_path, config=args)
    assert (tr.sampler, tr.fast_generation) == ("loop", True)
    tr = _trainer("grpo", tok, tmp_path, config=args, sampler="trl")  # keywords win
    assert tr.sampler == "trl"


@pytest.mark.parametrize("bad,match", [
    ({"sampler": "fast"}, "sampler must be one of .* got 'fast'"),
    ({"fast_generation": "yes"}, "fast_generation must be True or False, got 'yes'"),
    ({"fast_generation": False, "sampler": "loop"}, "fast_generation=False .* sampler='loop'"),
])
def test_bad_options_are_refused(tok, tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**_common(tmp_path, num_generations=2), **bad)
    with pytest.raises(ValueError, match=match):
        _trainer("rloo", tok, tmp_path, **bad)


def test_options_set_later_are_checked(tok, tmp_path):
    """`trainer.sampler = ...` and `trainer.fast_generation = ...` after construction: a bad
    value is refused at the assignment, naming it; fast_generation=False set later turns our
    samplers off whatever `sampler` says (TRL's generate serves: `_lce_sample` gives None)."""
    tr = _trainer("grpo", tok, tmp_path)
    with pytest.raises(ValueError, match="sampler must be one of .* got 'bogus'"):
        tr.sampler = "bogus"
    with pytest.raises(ValueError, match="fast_generation must be True or False, got 1"):
        tr.fast_generation = 1
    assert (tr.sampler, tr.fast_generation) == ("auto", True)  # unchanged by the refusals
    tr.sampler = "compiled"
    assert tr.sampler == "compiled"
    tr.fast_generation = False
    assert tr._lce_sample([[5, 6, 7]], None, None) is None


# --------------------------------------------------------------------------- GPU


def _cuda_policy(tok):
    """A small bf16 Llama on CUDA with LoRA on every linear layer (random B, so the adapter
    matters) and its final norm scaled up, so next-token distributions are peaked."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainers.tiny import tiny_model_dir

    path = tiny_model_dir(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
        model.get_base_model().model.norm.weight.mul_(4.0)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_train_with_the_decode_loop(kind, tok, tmp_path):
    """The real decode loop (trainers.sampling.loop) serves every generation of a 3-step
    train() on CUDA; for GRPO its log-probs reach TRL's importance-sampling correction.
    Bound on the mismatch: the loop and the trainer run the same bf16 weights through
    different kernels, which moves a log-prob by bf16 rounding through a 4-layer stack
    (~1e-2 nats); a log-prob of the wrong token or position is off by nats."""
    pytest.importorskip("trainers.sampling.loop")
    import torch

    ds = Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z"] * 4})
    common = _common(tmp_path, use_cpu=False, bf16=True, max_steps=3, max_completion_length=24)
    model = _cuda_policy(tok)
    if kind == "grpo":
        tr = GRPOTrainer(model=model, reward_funcs=_reward, processing_class=tok,
                         train_dataset=ds, sampler="loop",
                         args=trl.GRPOConfig(**common, num_generations=2, beta=0.0,
                                             vllm_importance_sampling_mode="token_truncate"))
    elif kind == "rloo":
        tr = RLOOTrainer(model=model, reward_funcs=_reward, processing_class=tok,
                         train_dataset=ds, sampler="loop",
                         args=trl.RLOOConfig(**common, num_generations=2))
    else:
        teacher = _cuda_policy(tok).merge_and_unload()
        tr = DistillationTrainer(model=model, teacher_model=teacher, processing_class=tok,
                                 train_dataset=ds, sampler="loop",
                                 args=trl.DistillationConfig(**common,
                                                             gradient_checkpointing=False))
    seen = _record_completions(tr)
    tr.train()
    samplers = tr._lce_samplers
    assert samplers.loop_off is None and samplers.loop.disabled_reason is None, (
        samplers.loop_off or samplers.loop.disabled_reason)
    assert samplers.served == {"loop": len(seen), "compiled": 0, "trl": 0} and seen
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert all("fast_generation/loop_calls" in h for h in logs)
    if kind == "grpo":
        diffs = [h["sampling/sampling_logp_difference/mean"] for h in logs]
        assert all(0 <= d < 0.1 for d in diffs), diffs
        assert all(h["sampling/importance_sampling_ratio/mean"] > 0.5 for h in logs)
    torch.cuda.synchronize()
