"""trainers.generation.FastSampler and GRPOTrainer's fast on-policy sampling.

CPU tests run the sampler's own machinery (static cache reuse and growth, the warm-up check,
the recompile watchdog, fallbacks, EOS trimming, the trainer hook) with dynamo's "aot_eager"
backend forced onto the CPU: the decode step is traced and guarded as on a GPU, but executes the
same aten kernels as eager, so compiled and eager completions must be identical token for token.
GPU tests (`gpu`) run the real configuration, inductor with CUDA graphs, in bf16 and with a
bitsandbytes NF4 base: greedy completions against eager `generate`, an optimizer step that must
reach the captured graph, and a short GRPO `train()`.

    python -m pytest tests/test_generation.py -q            # CPU part
    python -m pytest tests/test_generation.py -q -m gpu     # on a CUDA machine
"""

from __future__ import annotations

import logging

import pytest
import torch
from _tiny_models import lora_tiny_llama
from transformers import GenerationConfig
from transformers.generation.configuration_utils import CompileConfig

from trainers.generation import FastSampler, trim_after_eos
from trainers.tiny import build_tokenizer

NEW = 10


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles as a new process would: dynamo's caches are per code object and
    process-wide, and every tiny Llama here shares one forward."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def cpu_sampler() -> FastSampler:
    config = CompileConfig(fullgraph=False, dynamic=False, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return FastSampler(config, devices=("cpu",))


def greedy(tok, new=NEW, **kw) -> GenerationConfig:
    kw = {"do_sample": False, **kw}
    return GenerationConfig(max_new_tokens=new, pad_token_id=tok.pad_token_id,
                            eos_token_id=[tok.eos_token_id], disable_compile=True, **kw)


def batch(tok, texts, device="cpu"):
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def eager(model, ids, mask, config):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


SHORT = ["7+5=", "hello there", "a"]  # longest 11 tokens: prompt capacity 16
LONG = ["x" * 70, "y", "the longest prompt of all, well past one hundred characters " * 2]


def test_compiled_equals_eager_and_cache_is_reused_then_grown(tok):
    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    for texts in (SHORT, ["1", "22", "333"], LONG, SHORT):
        ids, mask = batch(tok, texts)
        out = s.generate(model, ids, mask, greedy(tok))
        assert s.disabled_reason is None
        assert torch.equal(out, eager(model, ids, mask, greedy(tok)))
    # SHORT (11 tokens) makes a cache of 16 prompt tokens, which the 3-token prompts reuse; LONG
    # (121 tokens) grows it to 128 (max(121, 1.5 * 16), rounded to 16); SHORT then reuses the
    # grown cache: two warm-ups, no other compile.
    assert s.stats.compiles == 2
    assert s.stats.recompiling_calls == 0
    assert s.stats.calls == 4
    (entry,) = s._caches.values()
    assert (entry.capacity, entry.new_tokens, entry.growths) == (128, NEW, 1)


def test_prompt_capacity_rule():
    from trainers.generation import prompt_capacity

    assert [prompt_capacity(n) for n in (1, 16, 17, 65)] == [16, 16, 32, 80]
    assert prompt_capacity(17, previous=16) == 32  # max(17, 24) -> 32
    assert prompt_capacity(40, previous=32) == 48  # max(40, 48)
    assert prompt_capacity(300, previous=80) == 304  # the prompt itself is larger


@pytest.mark.slow  # 1 + MAX_GROWTHS compiles of the decode step
def test_growth_is_bounded_then_trls_path_takes_over(tok, caplog):
    """Ever longer prompts grow the cache MAX_GROWTHS times (one compile each); a prompt beyond
    the last growth is left to TRL's path for that call, without turning the sampler off."""
    from trainers.generation import MAX_GROWTHS

    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    lengths = [10, 20, 40, 80, 160]  # capacities 16, 32, 48, 80, then 160 would be a 4th growth
    assert len(lengths) == MAX_GROWTHS + 2
    outs = []
    with caplog.at_level(logging.WARNING):
        for n in lengths + [12]:
            ids, mask = batch(tok, ["x" * n, "y"])
            outs.append(s.generate(model, ids, mask, greedy(tok)))
    assert [o is None for o in outs] == [False, False, False, False, True, False]
    assert s.disabled_reason is None
    assert s.stats.compiles == 1 + MAX_GROWTHS
    assert sum("does not fit" in r.getMessage() for r in caplog.records) == 1


# a compile; fresh weights in the default suite:
# test_trainer_train_generates_with_each_steps_weights
@pytest.mark.slow
def test_in_place_optimizer_step_reaches_the_compiled_step(tok):
    """Fails if generation uses stale weights: an optimizer step changes the greedy completion,
    and the sampler must produce eager's new completion, not the old one."""
    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    ids, mask = batch(tok, SHORT)
    before = s.generate(model, ids, mask, greedy(tok))
    assert torch.equal(before, eager(model, ids, mask, greedy(tok)))
    lora = [p for p in model.parameters() if p.requires_grad]
    ptrs = [p.data_ptr() for p in lora]
    opt = torch.optim.AdamW(lora, lr=0.5)
    logits = model(input_ids=before).logits.float()
    (-logits[..., 0].mean()).backward()  # push every position towards token 0
    opt.step()
    assert [p.data_ptr() for p in lora] == ptrs  # the optimizer updates in place
    after_eager = eager(model, ids, mask, greedy(tok))
    assert not torch.equal(after_eager, before), "the step must change the greedy completion"
    assert torch.equal(s.generate(model, ids, mask, greedy(tok)), after_eager)
    assert s.stats.compiles == 1 and s.stats.recompiling_calls == 0


@pytest.mark.slow  # a compile of the decode step
def test_sampling_settings_pass_through(tok):
    """top-k 1 with sampling is greedy whatever the RNG: the processors reach the compiled path."""
    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    ids, mask = batch(tok, SHORT)
    cfg = greedy(tok, do_sample=True, top_k=1, temperature=0.7, repetition_penalty=1.3)
    torch.manual_seed(0)
    out = s.generate(model, ids, mask, cfg)
    assert torch.equal(out, eager(model, ids, mask, greedy(tok, repetition_penalty=1.3)))


def test_failure_falls_back_with_one_logged_line(tok, caplog, monkeypatch):
    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    ids, mask = batch(tok, SHORT)

    def broken(*args, **kwargs):
        raise RuntimeError("capture failed\nsecond line")

    monkeypatch.setattr(model, "generate", broken)
    with caplog.at_level(logging.WARNING):
        assert s.generate(model, ids, mask, greedy(tok)) is None
        assert s.generate(model, ids, mask, greedy(tok)) is None
    assert s.disabled_reason == "RuntimeError: capture failed"
    lines = [r for r in caplog.records if "fast generation off" in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.slow  # MAX_RECOMPILING_CALLS + 1 compiles of the decode step
def test_recompiles_at_a_warmed_shape_turn_the_sampler_off(tok):
    """A guard that fails on every call (here a Python float the attention reads, changed each
    time) would recompile the decode step without bound; the sampler stops after
    MAX_RECOMPILING_CALLS such calls."""
    from trainers.generation import MAX_RECOMPILING_CALLS

    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    ids, mask = batch(tok, SHORT)
    attn = model.get_base_model().model.layers[0].self_attn
    for i in range(MAX_RECOMPILING_CALLS + 2):
        attn.scaling *= 1.0 + 1e-3
        out = s.generate(model, ids, mask, greedy(tok))
        if out is None:
            break
    assert s.disabled_reason is not None and "recompiled" in s.disabled_reason
    # call 0 warms up; calls 1..MAX recompile (their samples are still served, then the
    # sampler turns off); the next call is refused
    assert i == MAX_RECOMPILING_CALLS + 1


def test_warmup_check_rejects_wrong_logits(tok, monkeypatch):
    """A compiled step that computes something else is caught before any sample is returned."""
    import trainers.generation as g

    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    ids, mask = batch(tok, SHORT)
    real = g.FastSampler._generate

    def skewed(self, model, input_ids, attention_mask, config, cache):
        out = real(self, model, input_ids, attention_mask, config, cache)
        if getattr(out, "logits", None) is not None:
            out.logits = tuple(x + 10.0 * torch.randn_like(x) for x in out.logits)
        return out

    monkeypatch.setattr(g.FastSampler, "_generate", skewed)
    assert s.generate(model, ids, mask, greedy(tok)) is None
    assert "differ from eager" in s.disabled_reason


@pytest.mark.parametrize("reason_cfg,expect", [
    (dict(num_beams=2), "beam"),
    (dict(cache_implementation="offloaded"), "cache_implementation"),
])
def test_unsupported_configs_fall_back(tok, reason_cfg, expect):
    model = lora_tiny_llama(tok)
    s = cpu_sampler()
    ids, mask = batch(tok, SHORT)
    assert s.generate(model, ids, mask, greedy(tok, **reason_cfg)) is None
    assert expect in s.disabled_reason


def test_default_sampler_is_cuda_only(tok):
    model = lora_tiny_llama(tok)
    s = FastSampler()
    ids, mask = batch(tok, SHORT)
    assert s.generate(model, ids, mask, greedy(tok)) is None
    assert s.disabled_reason == "it needs a CUDA device"


def test_bnb_4bit_compile_check_is_lifted_for_one_call_only():
    """transformers refuses to compile a bitsandbytes 4-bit model; the sampler lifts that check
    for its own call (the quantizer read through a view), and restores the quantizer after,
    also when the call raises."""
    from transformers import BitsAndBytesConfig

    from trainers.generation import _compile_allowed

    class Bnb4BitHfQuantizer:  # the name transformers gives it; not compileable, as there
        is_compileable = False
        quantization_config = BitsAndBytesConfig(load_in_4bit=True)

    class Model:
        hf_quantizer = None

    model, quantizer = Model(), Bnb4BitHfQuantizer()
    model.hf_quantizer = quantizer
    with _compile_allowed(model):
        assert model.hf_quantizer.is_compileable
        assert model.hf_quantizer.quantization_config is quantizer.quantization_config
    assert model.hf_quantizer is quantizer
    with pytest.raises(RuntimeError), _compile_allowed(model):
        raise RuntimeError
    assert model.hf_quantizer is quantizer

    class OtherQuantizer:
        is_compileable = False
        quantization_config = None

    model.hf_quantizer = other = OtherQuantizer()
    with _compile_allowed(model):  # other quantizers keep their own answer
        assert model.hf_quantizer is other


def test_trim_after_eos_matches_trls_rule():
    """TRL keeps each completion up to and including its first EOS (any of several ids)."""
    g = torch.Generator().manual_seed(0)
    comp = torch.randint(3, 20, (64, 12), generator=g)
    eos = [1, 2]
    put = torch.rand(64, 12, generator=g) < 0.08
    comp[put] = torch.randint(1, 3, (int(put.sum()),), generator=g)
    got = trim_after_eos(comp, eos)
    for row, kept in zip(comp.tolist(), got):
        first = next((i for i, t in enumerate(row) if t in eos), None)
        assert kept == (row if first is None else row[:first + 1])


# --------------------------------------------------------------------------- trainer


def _trainer(tok, tmp_path, beta=0.0, peft_config=False, **kw):
    """A GRPOTrainer on the tiny LoRA Llama (passed wrapped, or bare with `peft_config`)."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    from trainers import GRPOTrainer

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=NEW,
        logging_steps=1, save_strategy="no", seed=0, max_steps=3, learning_rate=0.05,
        beta=beta, generation_kwargs={"do_sample": False})
    ds = Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z"] * 4})
    if peft_config:
        model = lora_tiny_llama(tok, peft=False)
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    else:
        model = lora_tiny_llama(tok)
    if kw.get("fast_generation", True) is True:
        kw.setdefault("sampler", "compiled")  # FastSampler, this file's subject
    return GRPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                       reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                       **kw)


def test_trainer_fast_path_equals_trl_path(tok, tmp_path):
    tr = _trainer(tok, tmp_path)
    tr._lce_sampler = cpu_sampler()
    prompt_ids = [tok(t).input_ids for t in SHORT + LONG]
    fast, _ = tr._generate_single_turn(prompt_ids, None, {}, 4)
    assert tr._lce_sampler.stats.calls == 1 and tr._lce_sampler.disabled_reason is None
    tr.fast_generation = False
    slow, _ = tr._generate_single_turn(prompt_ids, None, {}, 4)
    assert fast == slow


# a training run each: the "ref" adapter copy (beta > 0) in the default suite, the others slow
@pytest.mark.parametrize("beta,peft_config", [pytest.param(0.0, False, marks=pytest.mark.slow),
                                              (0.04, False),
                                              pytest.param(0.04, True, marks=pytest.mark.slow)])
def test_trainer_train_compiles_once_and_logs_timing(tok, tmp_path, beta, peft_config):
    """TRL's reference pass switches or disables the adapter every step (with a wrapped model
    and beta > 0, a "ref" adapter copy; with `peft_config`, the adapter disabled); neither may
    make the decode step compile again."""
    tr = _trainer(tok, tmp_path, beta=beta, peft_config=peft_config)
    tr._lce_sampler = cpu_sampler()
    tr.args.gradient_checkpointing = True  # TRL toggles it around every generation
    tr.train()
    s = tr._lce_sampler
    assert s.disabled_reason is None
    assert (s.stats.compiles, s.stats.recompiling_calls, s.stats.calls) == (1, 0, 3)
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 3
    assert all(h["timing/generation_s"] > 0 and h["fast_generation/compiles"] == 1 for h in logs)


def test_config_fields_and_keywords(tok, tmp_path):
    from trl import TrlParser

    from trainers import GRPOConfig

    (cfg,) = TrlParser(GRPOConfig).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--packing", "false",
         "--fast_generation", "false", "--max_packed_tokens", "256"])
    assert (cfg.packing, cfg.fast_generation, cfg.max_packed_tokens) == (False, False, 256)
    with pytest.raises(ValueError, match="packing"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, packing="sometimes")
    tr = _trainer(tok, tmp_path)  # stock trl.GRPOConfig: the defaults
    assert (tr.packing, tr.fast_generation, tr.max_packed_tokens) == ("auto", True, None)
    tr = _trainer(tok, tmp_path, fast_generation=False, packing=True)
    assert (tr.packing, tr.fast_generation) == (True, False)
    with pytest.raises(ValueError, match="fast_generation"):
        _trainer(tok, tmp_path, fast_generation="yes")


# --------------------------------------------------------------------------- GPU


def _cuda_model(tok, *, peaked=8.0, quantize=False, seed=0):
    """A small Llama on CUDA in bf16 (or NF4 + bf16 compute), LoRA on every linear layer, its
    final norm scaled so next-token distributions are peaked and greedy choices are not decided
    by bf16 rounding."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainers.tiny import tiny_model_dir

    kw = {"dtype": torch.bfloat16, "device_map": {"": 0}}
    if quantize:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    path = tiny_model_dir(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4)
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
        model.get_base_model().model.norm.weight.mul_(peaked)
    return model


def _gpu_greedy_identity(tok, quantize):
    model = _cuda_model(tok, quantize=quantize)
    texts = ["<|user|>what is 17 + 25?<|end|><|assistant|>", "x" * 90, "hello",
             "The quick brown fox jumps over the lazy dog. " * 3] * 2
    ids, mask = batch(tok, texts, "cuda")
    s = FastSampler()
    cfg = greedy(tok, new=48)
    ref = eager(model, ids, mask, cfg)
    out = s.generate(model, ids, mask, cfg)
    assert s.disabled_reason is None, s.disabled_reason
    assert torch.equal(out, ref)
    out2 = s.generate(model, ids, mask, cfg)  # a replay of the captured graph
    assert torch.equal(out2, ref)
    assert s.stats.recompiling_calls == 0


@pytest.mark.gpu
def test_gpu_bf16_greedy_equals_eager(tok):
    _gpu_greedy_identity(tok, quantize=False)


@pytest.mark.gpu
def test_gpu_nf4_greedy_equals_eager(tok):
    pytest.importorskip("bitsandbytes")
    _gpu_greedy_identity(tok, quantize=True)


@pytest.mark.gpu
def test_gpu_optimizer_step_reaches_the_captured_graph(tok):
    model = _cuda_model(tok)
    ids, mask = batch(tok, SHORT * 2, "cuda")
    s = FastSampler()
    cfg = greedy(tok, new=24)
    before = s.generate(model, ids, mask, cfg)
    assert torch.equal(before, eager(model, ids, mask, cfg))
    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(lora, lr=0.05)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=before).logits.float()
    (-logits[..., 5].mean()).backward()
    opt.step()
    after_eager = eager(model, ids, mask, cfg)
    assert not torch.equal(after_eager, before), "the step must change the greedy completion"
    assert torch.equal(s.generate(model, ids, mask, cfg), after_eager)
    assert s.stats.compiles == 1 and s.stats.recompiling_calls == 0


def _train_checking_each_generation(tok, tmp_path, model, *, device, sampler=None):
    """A 4-step GRPO train() whose every generation also runs a greedy check on a fixed batch:
    the sampler's completion (the same cache entry, so the graph compiled at the first step)
    against eager `generate` on the weights of that moment. Training samples at temperature 4,
    so completions and rewards vary and the weights move. Returns the trainer and the
    (sampler, eager) completion pairs, one per generation."""
    import trl
    from datasets import Dataset

    from trainers import GRPOTrainer

    new, G = 12, 8
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=device == "cpu",
        bf16=device == "cuda", per_device_train_batch_size=G, num_generations=4,
        max_completion_length=new, logging_steps=1, save_strategy="no", seed=0, max_steps=4,
        learning_rate=0.3,  # large on purpose: the greedy completion must change within 4 steps
        gradient_checkpointing=True, beta=0.04, temperature=4.0)
    ds = Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z"] * 8})
    tr = GRPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                     reward_funcs=lambda completions, **k: [float(c.count("a") - c.count("e"))
                                                            for c in completions],
                     sampler="compiled")  # FastSampler, this file's subject
    if sampler is not None:
        tr._lce_sampler = sampler
    s = tr._lce_sampler
    ids, mask = batch(tok, (SHORT * 3)[:G], device)  # batch G and one prompt bucket: the
    check_cfg = greedy(tok, new=new)                  # training calls' cache entry
    checks = []
    sample = s.generate

    def sample_then_check(model, *a, **k):
        out = sample(model, *a, **k)  # the call TRL made
        checks.append((sample(model, ids, mask, check_cfg), eager(model, ids, mask, check_cfg)))
        return out

    s.generate = sample_then_check
    tr.train()
    return tr, checks


def _assert_fresh_weights_every_step(tr, checks):
    s = tr._lce_sampler
    assert s.disabled_reason is None, s.disabled_reason
    assert (s.stats.calls, s.stats.recompiling_calls) == (2 * 4, 0)
    assert 1 <= s.stats.compiles <= 2  # one per prompt bucket
    for step, (mine, ref) in enumerate(checks):
        rows = (mine != ref).any(-1).nonzero().flatten().tolist() if mine.shape == ref.shape \
            else "shapes differ"
        assert torch.equal(mine, ref), (
            f"generation {step}: the compiled step != eager in rows {rows} "
            f"(calls {s.stats.calls}, compiles {s.stats.compiles})\n{mine}\n{ref}")
    assert not torch.equal(checks[0][1], checks[-1][1]), "training must change the greedy output"


def test_trainer_train_generates_with_each_steps_weights(tok, tmp_path):
    """Fails if generation inside train() uses stale weights: after every optimizer step the
    compiled step's greedy completion equals eager's on the updated model."""
    tr, checks = _train_checking_each_generation(tok, tmp_path, lora_tiny_llama(tok),
                                                 device="cpu", sampler=cpu_sampler())
    _assert_fresh_weights_every_step(tr, checks)


@pytest.mark.gpu
def test_gpu_grpo_train_uses_the_compiled_sampler_with_each_steps_weights(tok, tmp_path):
    """The same through inductor + CUDA graphs: the graph captured at the first step sees every
    later optimizer step."""
    tr, checks = _train_checking_each_generation(tok, tmp_path, _cuda_model(tok, peaked=1.0),
                                                 device="cuda")
    _assert_fresh_weights_every_step(tr, checks)
