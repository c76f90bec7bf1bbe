"""trainers.sampling: the decode loop, its functional forward and its logits processing.

CPU tests run the loop eagerly (the same steps a CUDA graph captures) on tiny random fp32 Llama,
Qwen2 (q/k/v biases, a sliding-window layer), Qwen3 (q/k norms, head_dim != hidden / heads) and
Mistral (sliding window shorter than the prompts) models, with and without a LoRA adapter:
greedy completions token-identical to HF `generate`, sampled log-probs equal to an fp64
recomputation through transformers' own logits processors, the first-step logits against the
eager forward, seeded repeatability, the unsupported cases and the one-line fallbacks.
GPU tests (`gpu`) capture the steps as CUDA graphs: bf16 and NF4 + LoRA greedy against eager
`generate`, replays after an optimizer step, host checks and capture time.

    python -m pytest tests/test_sampling_loop.py -q            # CPU part
    python -m pytest tests/test_sampling_loop.py -q -m gpu     # on a CUDA machine
"""

from __future__ import annotations

import copy
import logging
import math
import types
import weakref

import pytest
import torch
from _tiny_models import with_lora
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trainers import tiny
from trainers.generation import trim_after_eos
from trainers.sampling import DecodeLoop, decode_attention, processors
from trainers.sampling.cache import KVCache
from trainers.sampling.kernels import linear4bit_ws
from trainers.sampling.model_step import ModelStep

NEW = 14
PROMPTS = ["7+5=", "hello there, general", "a", "the quick brown fox jumps over", "xy"]


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # one full and one sliding layer, a window shorter than most prompts
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 6, "head_dim": 16}),
}


def build(tok, family, *, lora=False, seed=0, **config_kw):
    """A tiny random fp32 model of `family` with a softened untied head (entropies of a few
    nats, so greedy paths vary and sampling has choices; a tied head at this scale mostly
    repeats the last token); biases and q/k norms randomised so they matter; with `lora`, an
    adapter with non-zero B. `config_kw` adds to the family's config arguments."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = tiny._tiny_config(config_cls, tok, **{
        "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 128, "tie_word_embeddings": False, **extra, **config_kw})
    model = tiny._tiny_model(model_cls, config, tok, seed)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 3)
        model.get_output_embeddings().weight.mul_(0.5)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.eval()
    return with_lora(model, seed=seed) if lora else model


def batch(tok, texts=PROMPTS):
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    return enc.input_ids, enc.attention_mask


def config(tok, eos, new=NEW, **kw):
    kw = {"do_sample": False, **kw}
    return GenerationConfig(max_new_tokens=new, pad_token_id=tok.pad_token_id,
                            eos_token_id=eos, **kw)


def hf_completions(model, ids, mask, gc):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return trim_after_eos(out[:, ids.shape[1]:], gc.eos_token_id)


def mid_eos(model, tok, ids, mask):
    """An EOS id that HF's greedy completions hit in the middle of some rows while others run
    to max_new_tokens: the token with the most rows first hitting it at step >= 1 among those
    that some row never emits."""
    free = hf_completions(model, ids, mask, config(tok, [len(tok) + 7]))  # an id never drawn
    return spread_eos(free)


def spread_eos(rows, never=None):
    """The id with the most rows first emitting it at step >= 1, among ids some row never
    emits (so rows stop at different lengths and some run to the end); `never` if none."""
    best, score = never, -1
    for t in {t for row in rows for t in row}:
        firsts = [row.index(t) if t in row else None for row in rows]
        hits = sum(f is not None and f >= 1 for f in firsts)
        if None in firsts and hits > score:
            best, score = t, hits
    return best


def cpu_loop(**kw):
    return DecodeLoop(devices=("cpu",), check_every=4, **kw)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_generate(tok, family, lora):
    model = build(tok, family, lora=lora)
    ids, mask = batch(tok)
    eos = mid_eos(model, tok, ids, mask)
    gc = config(tok, [eos])
    ref = hf_completions(model, ids, mask, gc)
    ends_early = [len(r) < NEW for r in ref]
    assert any(ends_early) and not all(ends_early), ref  # EOS mid-row and max_new_tokens both
    loop = cpu_loop()
    out = loop.generate(model, ids, mask, gc)
    assert loop.disabled_reason is None and out is not None and loop.stats.calls == 1
    assert out.token_ids == ref
    assert [len(lp) for lp in out.logprobs] == [len(r) for r in ref]
    assert all(lp <= 0 for row in out.logprobs for lp in row)
    # second call reuses the cache and state: same result again
    again = loop.generate(model, ids, mask, gc)
    assert again.token_ids == ref and loop.stats.calls == 2 and loop.stats.growths == 0


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    "mistral"])
def test_greedy_with_triton_decode_attention(tok, family, monkeypatch):
    """The plan's `attention` alone: decode steps read each row's valid keys only (the Triton
    interpreter on CPU), token-identical to HF; Qwen2 / Mistral with sliding windows."""
    from trainers.sampling import model_step

    calls = []
    real = model_step.decode_attention
    monkeypatch.setattr(model_step, "decode_attention",
                        lambda *a, **kw: calls.append(kw["window"]) or real(*a, **kw))
    attention_only(monkeypatch)
    model = build(tok, family, lora=True)
    ids, mask = batch(tok)
    gc = config(tok, [len(tok) + 7], new=8)
    loop = DecodeLoop(devices=("cpu",), check_every=4)
    out = loop.generate(model, ids, mask, gc)
    assert loop.disabled_reason is None and out is not None
    assert out.token_ids == hf_completions(model, ids, mask, gc)
    assert len(calls) >= 2 * 7  # 2 layers, every decode step (the kernel ran)
    assert (6 in calls) == (family != "llama")  # the sliding layers passed their window


def attention_only(monkeypatch):
    """The loop's kernel plans reduced to `decode_attention` (the Triton interpreter on CPU):
    the attention kernel alone, the rest of the step the modules'."""
    from trainers.sampling import loop as loop_module
    from trainers.sampling.kernel_plan import KernelPlan

    monkeypatch.setattr(loop_module, "make_plan", lambda *a, **kw: KernelPlan(
        attention=True, line="attention by decode_attention (test plan)"))


def fake_graphs(monkeypatch):
    """The capture path on CPU: a "graph" is the captured call, holding its tensors weakly as a
    CUDA graph holds only their addresses (a replay that would read one freed since capture,
    its memory reused by then, fails); returns the list of the working batch each capture was
    made for."""
    from trainers.sampling import loop as loop_module

    made = []

    def fake_graph(run, pool, stream):
        func = run.func
        args = [weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in run.args]
        made.append(run.args[2].cur.shape[0])

        def replay():
            live = [a() if isinstance(a, weakref.ref) else a for a in args]
            assert all(a is not None for a in live), "a graph reads a tensor freed since capture"
            func(*live)

        return types.SimpleNamespace(replay=replay)

    monkeypatch.setattr(loop_module, "CAPTURE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(loop_module, "_graph_of", fake_graph)
    return made


def test_replay_path_with_a_fake_graph(tok, monkeypatch):
    """The capture path on CPU: a warm-up step that must leave no trace, then k-step "graphs"
    (here the captured function, holding its tensors weakly as a graph holds only their
    addresses) replayed per host check, a shorter prompt reusing the
    graph, and a new graph when the model state changes; completions equal HF's throughout."""
    made = fake_graphs(monkeypatch)
    model = build(tok, "qwen2", lora=True)
    ids, mask = batch(tok)
    eos = mid_eos(model, tok, ids, mask)
    gc = config(tok, [eos], repetition_penalty=1.2)
    loop = cpu_loop()
    for i, j in ((0, None), (0, None), (2, None)):  # full batch twice, then shorter prompts
        out = loop.generate(model, ids[:, i:j], mask[:, i:j], gc)
        assert out.token_ids == hf_completions(model, ids[:, i:j], mask[:, i:j], gc)
    assert loop.stats.captures == len(made) == 1
    with model.disable_adapter():
        assert loop.generate(model, ids, mask, gc).token_ids == \
            hf_completions(model, ids, mask, gc)
    assert loop.stats.captures == 2
    # sampling: the warm-up step leaves neither state nor random stream behind, so the seeded
    # draws equal the eager path's
    gs = config(tok, [eos], do_sample=True, temperature=1.0, top_k=0)
    runs = []
    for lp in (loop, cpu_loop(capture=False)):
        torch.manual_seed(3)
        runs.append(lp.generate(model, ids, mask, gs))
    assert loop.stats.captures == 3
    assert runs[0].token_ids == runs[1].token_ids and runs[0].logprobs == runs[1].logprobs


def test_lora_changes_the_completions(tok):
    """The adapter is live in the loop's forward: disabling it changes the greedy tokens as
    it changes HF's."""
    model = build(tok, "llama", lora=True)
    ids, mask = batch(tok)
    gc = config(tok, [len(tok) + 7])
    loop = cpu_loop()
    with_adapter = loop.generate(model, ids, mask, gc).token_ids
    with model.disable_adapter():
        without = loop.generate(model, ids, mask, gc).token_ids
        assert without == hf_completions(model, ids, mask, gc)
    assert with_adapter != without


def test_cache_grows_for_a_longer_prompt(tok, caplog):
    model = build(tok, "qwen3")
    gc = config(tok, [len(tok) + 7])
    loop = cpu_loop()
    short = batch(tok, ["ab", "c", "de", "f", "g"])
    long = batch(tok, ["a much longer prompt than the first, " * 2, "c", "de", "f", "g"])
    with caplog.at_level(logging.WARNING):
        for ids, mask in (short, long, short):
            assert loop.generate(model, ids, mask, gc).token_ids == \
                hf_completions(model, ids, mask, gc)
    assert loop.stats.growths == 1
    assert sum("grown" in r.getMessage() for r in caplog.records) == 1


def test_caches_of_one_capacity_keep_their_own_graphs(tok, monkeypatch):
    """Two caches of one batch and one capacity M = C + N + S (a 4-token call after a prompt
    of room C = 32, a 20-token call after one of C = 16): each call replays a graph captured on
    its own cache, so the log-probs equal the eager path's (a graph of the other cache reads
    its prompt)."""
    from trainers.sampling import loop as loop_module

    monkeypatch.setattr(loop_module, "CAPTURE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(loop_module, "_graph_of",
                        lambda run, pool, stream: types.SimpleNamespace(replay=run))
    model = build(tok, "llama")
    long = batch(tok, ["a longer prompt, yes", "c", "de"])
    short = batch(tok, ["ab", "c", "de"])
    assert 16 < long[0].shape[1] <= 32 and short[0].shape[1] <= 16
    loop, eager = cpu_loop(), cpu_loop(capture=False)
    for (ids, mask), n in ((long, 4), (short, 20), (long, 4), (short, 20)):
        gc = config(tok, [len(tok) + 7], new=n)
        ours, ref = loop.generate(model, ids, mask, gc), eager.generate(model, ids, mask, gc)
        assert ours.token_ids == ref.token_ids and ours.logprobs == ref.logprobs
    caps = {c.capacity for c in loop._caches.values()}
    assert len(loop._caches) == 2 and len(caps) == 1, caps
    # allocating the second cache drops the batch's states, so the third call captures anew
    assert loop.stats.captures == 3


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_first_step_logits_match_eager_forward(tok, family):
    """Prefill logits at each row's last prompt token and the first decode step's logits
    against HF's eager forward of the left-padded batch (fp32). Both evaluate the same sums in
    different orders (masked SDPA over P_max keys vs P_b, other GEMM shapes): per layer a
    K-term fp32 dot product is off by at most K·2^-24 relative to the sum of |terms|, K <= 128
    here (MLP inner size), through 2 layers and the head; 4·K·2^-24·max|z| bounds it."""
    model = build(tok, family, lora=True)
    ids, mask = batch(tok)
    lengths = mask.sum(1)
    P = ids.shape[1]
    shift = (P - lengths)[:, None]
    left = ids.gather(1, (torch.arange(P)[None] + shift).clamp(max=P - 1))
    cache = KVCache.allocate(model.get_base_model().config, batch=len(PROMPTS), room=32,
                             new_tokens=4, slack=4, growths=0, dtype=torch.float32,
                             device="cpu")
    step = ModelStep(model)
    with torch.no_grad():
        z0 = step.prefill(cache, left, lengths)
        y0 = z0.argmax(-1)
        z1 = step.decode(cache, y0, lengths)
        ref = model(input_ids=torch.cat([ids, y0[:, None]], 1),
                    attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1)).logits
    for ours, theirs in ((z0, ref[:, -2]), (z1, ref[:, -1])):
        bound = 4 * 128 * 2.0**-24 * theirs.abs().max().item()
        err = (ours - theirs).abs().max().item()
        assert err <= bound, (err, bound)


# -- sampling -----------------------------------------------------------------------------

SAMPLING = {
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.2, "temperature": 1.3},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "all": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
            "repetition_penalty": 1.2},
}


def hf_processors(opts, pad_lengths):
    """transformers' own processors, in `generate`'s order, for the options in `opts`."""
    out = LogitsProcessorList()
    if opts.get("repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(opts["repetition_penalty"],
                                                    prompt_ignore_length=pad_lengths))
    if opts.get("temperature", 1.0) != 1.0:
        out.append(TemperatureLogitsWarper(opts["temperature"]))
    if opts.get("top_k"):
        out.append(TopKLogitsWarper(opts["top_k"]))
    if opts.get("top_p", 1.0) < 1.0:
        out.append(TopPLogitsWarper(opts["top_p"]))
    if opts.get("min_p") is not None:
        out.append(MinPLogitsWarper(opts["min_p"]))
    return out


def recompute_logprobs(model, ids, mask, completions, opts, dtype):
    """Each completion token's log-prob under the processed distribution, recomputed with
    the model in `dtype` over the full sequences and transformers' processors."""
    m = copy.deepcopy(model).to(dtype)
    B, P = ids.shape
    N = max(len(c) for c in completions)
    comp = torch.zeros(B, N, dtype=torch.long)  # right padding, masked
    cmask = torch.zeros(B, N, dtype=mask.dtype)
    for b, c in enumerate(completions):
        comp[b, :len(c)] = torch.tensor(c)
        cmask[b, :len(c)] = 1
    seq = torch.cat([ids, comp], 1)
    full = torch.cat([mask, cmask], 1)
    with torch.no_grad():  # positions as `generate` gives a left-padded row: from 0 at its start
        logits = m(input_ids=seq, attention_mask=full,
                   position_ids=(full.cumsum(1) - 1).clamp(min=0)).logits
    procs = hf_processors(opts, (mask == 0).sum(1))
    out = [[] for _ in range(B)]
    for t in range(N):
        z = procs(seq[:, :P + t], logits[:, P + t - 1].clone())
        lp = torch.log_softmax(z, -1)
        for b, c in enumerate(completions):
            if t < len(c):
                out[b].append(lp[b, c[t]].item())
    return out


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampled_logprobs_equal_the_processed_distribution(tok, name):
    """Three-way: |ours - fp64| <= 8·|HF fp32 recompute - fp64| + 2e-5. Ours runs the fp32
    forward one token at a time, the fp32 recompute the whole sequence at once: both carry
    fp32 rounding of the same size (the factor 8 covers the different summation orders;
    2e-5 ≈ 2^-16 the floor of a log-softmax over |z| <= 16 logits in fp32)."""
    opts = SAMPLING[name]
    model = build(tok, "qwen2", lora=True)
    ids, mask = batch(tok)
    # top_k explicit, as TRL passes it: left unset, `generate` (and the loop) take
    # transformers' default of 50, which truncates this 105-token vocabulary
    gc = config(tok, [tok.eos_token_id], do_sample=True, **{"top_k": 0, **opts})
    loop = cpu_loop()
    torch.manual_seed(1)
    out = loop.generate(model, ids, mask, gc)
    assert loop.disabled_reason is None and out is not None
    assert all(math.isfinite(lp) for row in out.logprobs for lp in row)
    ref64 = recompute_logprobs(model, ids, mask, out.token_ids, opts, torch.float64)
    ref32 = recompute_logprobs(model, ids, mask, out.token_ids, opts, torch.float32)
    flat = lambda rows: torch.tensor([x for r in rows for x in r], dtype=torch.float64)
    ours, r64, r32 = flat(out.logprobs), flat(ref64), flat(ref32)
    assert torch.isfinite(r64).all()  # every sampled token is inside fp64's kept set
    err, ref_err = (ours - r64).abs(), (r32 - r64).abs().max().item()
    i = int(err.argmax())
    assert err.max().item() <= 8 * ref_err + 2e-5, (i, ours[i].item(), r64[i].item(), ref_err)
    if name in ("top_k", "top_p", "min_p"):  # truncation: log-probs over the kept set only
        plain = recompute_logprobs(model, ids, mask, out.token_ids,
                                   {"temperature": opts.get("temperature", 1.0)}, torch.float64)
        assert (ours >= flat(plain) - 1e-5).all()
        assert (ours > flat(plain) + 1e-3).any()


def test_seeded_sampling_repeats(tok):
    model = build(tok, "llama", lora=True)
    ids, mask = batch(tok)
    gc = config(tok, [tok.eos_token_id], do_sample=True, temperature=1.0)
    loop = cpu_loop()
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(loop.generate(model, ids, mask, gc))
    assert runs[0].token_ids == runs[1].token_ids and runs[0].logprobs == runs[1].logprobs
    assert runs[0].token_ids != runs[2].token_ids


def test_processors_equal_transformers_processors():
    """Our graph-safe processing against transformers' processors on random logits with ties
    (integers / 4: many equal values at the top-k and top-p boundaries)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randint(-20, 20, (6, 50), generator=g).float() / 4
    prompt = torch.randint(0, 50, (6, 9), generator=g)
    pad_lengths = torch.tensor([0, 3, 1, 0, 8, 2])
    seen = torch.zeros(6, 50, dtype=torch.bool)
    for b in range(6):
        seen[b, prompt[b, pad_lengths[b]:]] = True
    for opts in SAMPLING.values():
        spec = processors.SamplingSpec(True, opts.get("temperature", 1.0), opts.get("top_k", 0),
                                       opts.get("top_p", 1.0), opts.get("min_p"),
                                       opts.get("repetition_penalty", 1.0))
        ours = processors.process(z.clone(), spec, seen)
        theirs = hf_processors(opts, pad_lengths)(prompt, z.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), opts
        kept = ~torch.isinf(theirs)
        assert torch.allclose(ours[kept], theirs[kept], rtol=1e-6, atol=0), opts


def test_sample_draws_from_softmax():
    """The exponential race draws token j with probability softmax(z)_j: 40000 draws per
    distribution, every frequency within 5 binomial standard deviations."""
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    n = 40000
    spec = processors.SamplingSpec(True)
    torch.manual_seed(0)
    y, lp = processors.sample(z.expand(n, -1).contiguous(), spec)
    p = torch.softmax(z[0], -1)
    freq = torch.bincount(y, minlength=6).double() / n
    sd = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p.double()).abs() <= 5 * sd + 1e-12).all(), (freq, p)
    assert torch.equal(lp, torch.log_softmax(z, -1)[0, y])


# -- refusals and failures -------------------------------------------------------------------

def test_unsupported_models_and_configs_give_a_reason(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    loop = cpu_loop()
    llama = build(tok, "llama")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in loop.unsupported_reason(gpt2, config(tok, [2]))
    assert "num_beams" in loop.unsupported_reason(llama, config(tok, [2], num_beams=2))
    assert "no_repeat_ngram_size" in loop.unsupported_reason(
        llama, config(tok, [2], no_repeat_ngram_size=2))
    assert "typical_p" in loop.unsupported_reason(
        llama, config(tok, [2], do_sample=True, typical_p=0.5))
    assert "cuda" in DecodeLoop().unsupported_reason(llama, config(tok, [2]))
    dyn = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64,
                                       rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                        "rope_theta": 10000.0}))
    assert "dynamic" in loop.unsupported_reason(dyn, config(tok, [2]))
    assert loop.unsupported_reason(llama, config(tok, [2], do_sample=True, top_k=4)) is None
    ids, mask = batch(tok)
    assert loop.generate(llama, ids, mask, config(tok, [2], num_beams=2)) is None
    assert loop.disabled_reason is None  # a refusal is per call, not the end of the loop


def test_config_resolves_like_generate(tok):
    """Options the caller leaves unset take the model's generation config, then transformers'
    defaults, as in `generate`: an unset top_k samples from the top 50."""
    from trainers.sampling.loop import _resolve_config

    llama = build(tok, "llama")
    spec, _ = processors.spec_from_config(
        _resolve_config(llama, config(tok, [2], do_sample=True)), len(tok))
    assert spec.top_k == 50 and spec.temperature == 1.0
    llama.generation_config.top_p = 0.5
    spec, _ = processors.spec_from_config(
        _resolve_config(llama, config(tok, [2], do_sample=True, top_k=0)), len(tok))
    assert spec.top_k == 0 and spec.top_p == 0.5


def test_graph_key_follows_what_a_capture_bakes_in(tok):
    """A captured graph bakes the train/eval mode, the parameter addresses and PEFT's adapter
    switches: each change gives a new key (a new capture); an in-place optimizer step does
    not (the replay reads the updated weights)."""
    from trainers.sampling.loop import _fingerprint

    model = build(tok, "llama", lora=True).eval()
    key = _fingerprint(model)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    assert _fingerprint(model) == key
    with model.disable_adapter():
        assert _fingerprint(model) != key
    assert _fingerprint(model) == key
    model.train()
    assert _fingerprint(model) != key
    model.eval()
    params[0].data = params[0].data.clone()
    assert _fingerprint(model) != key


def test_right_padded_batch_falls_back(tok):
    loop = cpu_loop()
    model = build(tok, "llama")
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="right")
    assert loop.generate(model, enc.input_ids, enc.attention_mask, config(tok, [2])) is None
    assert loop.disabled_reason is None and loop.stats.calls == 0


def test_forced_failure_disables_with_one_logged_line(tok, caplog, monkeypatch):
    model = build(tok, "llama")
    ids, mask = batch(tok)
    loop = cpu_loop()

    def broken(self, *args, **kwargs):
        raise RuntimeError("forced decode failure")

    monkeypatch.setattr(ModelStep, "decode", broken)
    with caplog.at_level(logging.WARNING):
        assert loop.generate(model, ids, mask, config(tok, [2])) is None
        assert loop.generate(model, ids, mask, config(tok, [2])) is None
    assert "forced decode failure" in loop.disabled_reason
    lines = [r for r in caplog.records if "decode loop off" in r.getMessage()]
    assert len(lines) == 1


def test_logits_mismatch_disables(tok, caplog, monkeypatch):
    model = build(tok, "llama")
    ids, mask = batch(tok)
    loop = cpu_loop()
    real = ModelStep._logits
    monkeypatch.setattr(ModelStep, "_logits", lambda self, *a, **kw: real(self, *a, **kw) * 1.01)
    with caplog.at_level(logging.WARNING):
        assert loop.generate(model, ids, mask, config(tok, [2])) is None
    assert "differ from the eager forward" in loop.disabled_reason
    assert sum("decode loop off" in r.getMessage() for r in caplog.records) == 1


# -- decode kernels in the forward (Triton interpreter) ---------------------------------------

def nf4_lora(tok, family, seed=0, **config_kw):
    """`build`'s tiny model in bf16 with every projection a bitsandbytes NF4 Linear4bit
    (double quant, bf16 compute), then a LoRA adapter with non-zero B: the kernels' case."""
    bnb = pytest.importorskip("bitsandbytes")
    model = build(tok, family, seed=seed, **config_kw).to(torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if type(lin) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features,
                                      bias=lin.bias is not None, compute_dtype=torch.bfloat16,
                                      quant_type="nf4")
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False,
                                             quant_type="nf4", compress_statistics=True)
                if lin.bias is not None:
                    q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                # bitsandbytes' CPU forward would repack the weight in place (AVX512 layout),
                # which the decode kernel does not read; the GPU has no such repacking
                q.support_avx512bf16_for_cpu = False
                setattr(parent, name, q.to("cpu"))  # quantizes here
    return with_lora(model, seed=seed).eval()


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """kernels="auto" on CPU (the Triton interpreter), a count of the kernels' calls, and of
    the projections they computed ("projections": one per decode_linear, one per module of a
    grouped decode_linears, two per decode_silu_mul)."""
    from trainers.sampling import kernel_plan, model_step
    from trainers.sampling import loop as loop_module

    monkeypatch.setattr(kernel_plan, "KERNEL_DEVICES", ("cuda", "cpu"))
    names = ("decode_linear", "decode_linears", "decode_silu_mul", "add_rmsnorm",
             "rope_cache_write", "head_logits", "decode_attention", "rope_attention")
    calls = dict.fromkeys(names + ("projections", "record_step", "embedding_lookups"), 0)
    real_record = loop_module.record_step

    def counted_record(*a, **kw):
        calls["record_step"] += 1
        return real_record(*a, **kw)

    monkeypatch.setattr(loop_module, "record_step", counted_record)
    for name in names:
        real = getattr(model_step, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            if _name == "decode_linear":
                calls["projections"] += 1
            elif _name == "decode_linears":
                calls["projections"] += len(a[1])
            elif _name == "decode_silu_mul":
                calls["projections"] += 2
            elif _name == "add_rmsnorm" and kw.get("ids") is not None:
                calls["embedding_lookups"] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(model_step, name, counted)
    return calls


def _kernel_logit_bound(z, layers):
    """|z_kernels - z_torch| per row: both forwards are bf16; decode_linear and add_rmsnorm
    differ from bitsandbytes + PEFT and transformers' RMSNorm by a bf16 rounding of their
    outputs (their docstrings' bounds), which the residual stream carries as in `_near_tie`:
    (2L + 2) ulps relative of the final hidden state, so (2L + 2) · ulp(max |z|) of a logit.
    A wrong nibble, scale, LoRA factor or residual changes logits by their own size."""
    zmax = z.abs().amax(-1)
    return torch.tensor([(2 * layers + 2) * _bf16_ulp(float(m)) for m in zmax.flatten()]) \
        .reshape(zmax.shape)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_kernel_forward_equals_the_modules(tok, family, kernels_on_cpu):
    """ModelStep with the kernel plan against the same forward through the modules, teacher
    forced (the torch path's greedy tokens): prefill (fused norms, module projections) and two
    decode steps (fused norms and the 4-bit + LoRA decode linear for all 14 projections), on
    NF4 + LoRA Llama and Qwen2 (q/k/v biases, a sliding layer)."""
    from trainers.sampling.kernel_plan import FUSED_LINEAR_MAX_ROWS, TORCH, make_plan

    model = nf4_lora(tok, family)
    base = model.get_base_model()
    plan = make_plan(base, "auto", "cpu", batch=3)
    assert len(plan.fused) == 14 and plan.norms, plan.line
    assert len(plan.groups) == 4 and "4 q/k/v or gate/up groups" in plan.line, plan.line
    assert len(plan.silu_mul) == 2 and "(2 gate/up with silu · mul)" in plan.line, plan.line
    # above FUSED_LINEAR_MAX_ROWS the projections stay with bitsandbytes; norms and RoPE fuse
    wide = make_plan(base, "auto", "cpu", batch=FUSED_LINEAR_MAX_ROWS + 1)
    assert not wide.fused and wide.norms and wide.rope, wide.line
    assert f"batch {FUSED_LINEAR_MAX_ROWS + 1} > {FUSED_LINEAR_MAX_ROWS} rows" in wide.line
    assert len(make_plan(base, "auto", "cpu", batch=FUSED_LINEAR_MAX_ROWS).fused) == 14
    ids, mask = batch(tok, PROMPTS[:3])
    lengths = mask.sum(1)
    P = ids.shape[1]
    left = ids.gather(1, (torch.arange(P)[None] + (P - lengths)[:, None]).clamp(max=P - 1))
    runs, tokens = {}, []
    for name, p in (("torch", TORCH), ("kernels", plan)):
        cache = KVCache.allocate(base.config, batch=3, room=P, new_tokens=3, slack=0,
                                 growths=0, dtype=torch.bfloat16, device="cpu")
        step = ModelStep(model, plan=p)
        with torch.no_grad():
            z = [step.prefill(cache, left, lengths)]
            for t in range(2):
                if name == "torch":
                    tokens.append(z[-1].argmax(-1))
                z.append(step.decode(cache, tokens[t], lengths + t))
        runs[name] = torch.stack(z, 1)  # (B, 3, V)
    assert kernels_on_cpu["projections"] == 2 * 14  # two decode steps, 2 layers x 7
    assert kernels_on_cpu["decode_linears"] == 2 * 2  # q/k/v in one launch
    assert kernels_on_cpu["decode_silu_mul"] == 2 * 2  # gate/up and silu · mul in one launch
    assert kernels_on_cpu["add_rmsnorm"] == 3 * 5  # prefill and decodes, 2 x 2 + final
    assert plan.embed and kernels_on_cpu["embedding_lookups"] == 2  # in the decode steps' first
    assert plan.head and kernels_on_cpu["head_logits"] == 2  # the decode steps' heads
    # decode steps only; RoPE and the cache write in the attention's launch (no q/k norms)
    assert plan.attention and plan.rope_attention and kernels_on_cpu["rope_attention"] == 2 * 2
    assert kernels_on_cpu["decode_attention"] == 0 and kernels_on_cpu["rope_cache_write"] == 0
    err = (runs["kernels"] - runs["torch"]).abs().amax(-1)  # (B, 3)
    bound = _kernel_logit_bound(runs["torch"], base.config.num_hidden_layers)
    assert (err <= bound).all(), (err, bound)


@pytest.mark.slow  # interpreted model steps; the SplitSum kernels alone: tests/test_split_sum.py
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_split_sums_change_no_logit(tok, family, kernels_on_cpu, monkeypatch):
    """The plan's rope_sums (q/k/v's partials summed by rope_cache_write) and norm_sums (o_proj's
    and down_proj's by add_rmsnorm) against the same plan without them: two decode steps'
    logits bit for bit, and the SplitSum path counted in both consumers. Every projection's K
    split in two (hidden 128: two absmax blocks, the block-a-step loop), q/k/v biases (Qwen2)
    and q/k norms (Qwen3). The plan's rule: rope_sums wherever the rope kernel runs, norm_sums
    wherever the fused norm does, at any batch."""
    import dataclasses

    from trainers.sampling.kernel_plan import make_plan
    from trainers.sampling.kernels import linear4bit, split_sum

    monkeypatch.setattr(linear4bit, "pick_config", lambda *a, **kw: {
        "BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4, "PREFETCH": True,
        "REG_TILE": False})
    model = nf4_lora(tok, family, hidden_size=128)
    base = model.get_base_model()
    plan = make_plan(base, "auto", "cpu", batch=3)
    assert plan.rope_sums and plan.norm_sums and len(plan.fused) == 14, plan.line
    assert "split-K q/k/v summed by rope_cache_write and o/down summed by add_rmsnorm" \
        in plan.line, plan.line
    wide = make_plan(base, "auto", "cpu", batch=linear4bit.REG_TILE_ROWS + 1)
    assert wide.rope_sums and wide.norm_sums, wide.line
    ids, mask = batch(tok, PROMPTS[:3])
    lengths = mask.sum(1)
    P = ids.shape[1]
    left = ids.gather(1, (torch.arange(P)[None] + (P - lengths)[:, None]).clamp(max=P - 1))
    runs, used = {}, {}
    for name, p in (("sums", plan),
                    ("sums_in_linear", dataclasses.replace(plan, rope_sums=False,
                                                           norm_sums=False))):
        cache = KVCache.allocate(base.config, batch=3, room=P, new_tokens=3, slack=0,
                                 growths=0, dtype=torch.bfloat16, device="cpu")
        step = ModelStep(model, plan=p)
        before = dict(split_sum.CONSUMED)
        with torch.no_grad():
            z = [step.prefill(cache, left, lengths)]
            for t in range(2):
                z.append(step.decode(cache, z[-1].argmax(-1), lengths + t))
        runs[name] = torch.stack(z, 1)
        used[name] = {k: v - before.get(k, 0) for k, v in split_sum.CONSUMED.items()}
    # per decode step: o and down into 2 layers' norms (the last down into the final norm);
    # q, k and v into each layer's rope_attention (rope_cache_write with Qwen3's q/k norms)
    rope = "rope_attention" if plan.rope_attention else "rope_cache_write"
    assert plan.rope_attention == (family != "qwen3"), plan.line
    assert {k: v for k, v in used["sums"].items() if v} == \
        {"add_rmsnorm": 2 * 4, rope: 2 * 2 * 3}, used
    assert not any(used["sums_in_linear"].values()), used
    assert torch.equal(runs["sums"], runs["sums_in_linear"])


# two interpreted NF4 loop runs; the loop with kernels in the default suite:
# test_greedy_with_kernels_equals_hf_generate[llama]
@pytest.mark.slow
def test_loop_with_kernels_equals_without(tok, kernels_on_cpu, caplog):
    """The whole loop (greedy, k-step checks) with kernels="auto" against kernels="torch" on
    NF4 + LoRA: one logged line names the path; tokens equal up to each row's first divergence,
    and log-probs there within 4δ, δ the logit bound of `_kernel_logit_bound` (|Δ log p| <=
    2δ for the same token; at a divergence the two tokens' torch gap is <= 2δ, so 4δ)."""
    model = nf4_lora(tok, "llama")
    ids, mask = batch(tok, PROMPTS[:3])
    gc = config(tok, [len(tok) + 7], new=4)
    with caplog.at_level(logging.WARNING):
        outs = {}
        for kernels in ("torch", "auto"):
            loop = DecodeLoop(devices=("cpu",), check_every=2, kernels=kernels)
            outs[kernels] = loop.generate(model, ids, mask, gc)
            assert loop.disabled_reason is None and outs[kernels] is not None
    lines = [r.getMessage() for r in caplog.records if "projections through" in r.getMessage()]
    assert len(lines) == 1 and "14 of 14 projections" in lines[0], lines
    assert "add_rmsnorm" in lines[0]
    assert kernels_on_cpu["projections"] >= 14 * 4  # check step + 3 decode steps, at least
    # max |z| of each row over its steps, from the eager forward of prompt + torch completion
    comp = torch.tensor(outs["torch"].token_ids)  # (B, 4): no EOS is ever drawn
    full = torch.cat([mask, torch.ones_like(comp)], 1)
    with torch.no_grad():
        z = model(input_ids=torch.cat([ids, comp], 1), attention_mask=full,
                  position_ids=(full.cumsum(1) - 1).clamp(min=0)).logits
    zmax = z[:, ids.shape[1] - 1:-1].float().abs().amax((1, 2))  # (B,)
    layers = model.get_base_model().config.num_hidden_layers
    for t, k, lt, lk, m in zip(outs["torch"].token_ids, outs["auto"].token_ids,
                               outs["torch"].logprobs, outs["auto"].logprobs, zmax.tolist()):
        n = next((i for i, (a, b) in enumerate(zip(t, k)) if a != b), len(t) - 1)
        delta = (2 * layers + 2) * _bf16_ulp(m)
        assert all(abs(a - b) <= 4 * delta for a, b in zip(lt[:n + 1], lk[:n + 1])), \
            (t, k, lt, lk, delta)


@pytest.mark.slow  # three interpreted loop runs; the kernel itself: tests/test_sampling_record.py
def test_record_kernel_changes_no_token(tok, kernels_on_cpu, monkeypatch):
    """The loop with kernels="auto", sampling with a seed, rows ending at an EOS id at different
    steps: the step's record by `record_step` (one launch, counted) against its torch ops,
    token ids and log-probs equal (the only difference is the record's path, whose results
    are integers and copies)."""
    from trainers.sampling import loop as loop_module
    from trainers.sampling.kernels.record import record_step_torch

    model = with_lora(build(tok, "llama"), seed=0)
    ids, mask = batch(tok, PROMPTS[:3])

    def run(eos):
        torch.manual_seed(5)
        out = cpu_loop(kernels="auto").generate(
            model, ids, mask, config(tok, [eos], new=7, do_sample=True, temperature=1.0))
        assert out is not None
        return out

    first = run(len(tok) + 7)  # never drawn: every row's 7 tokens
    # an id row 0 draws at step 3: at least that row ends early
    eos = first.token_ids[0][3]
    before = kernels_on_cpu["record_step"]
    kernel = run(eos)
    assert kernels_on_cpu["record_step"] > before
    monkeypatch.setattr(loop_module, "record_step", record_step_torch)
    torch_ops = run(eos)
    assert kernel.token_ids == torch_ops.token_ids and kernel.logprobs == torch_ops.logprobs
    lengths = [len(t) for t in kernel.token_ids]
    assert min(lengths) <= 4 and lengths[0] <= 4 and kernel.token_ids[0][-1] == eos, lengths


# two interpreted loop runs; the one-line fallback in the default suite:
# test_failing_kernels_turn_off_with_one_line
@pytest.mark.slow
def test_unservable_projections_fall_back_with_one_line(tok, kernels_on_cpu, caplog):
    """DoRA adapters: decode_linear serves no projection, the plan says why in one line (once
    for two calls), the projections run as module calls and the completions equal HF's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build(tok, "llama"), LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                                           target_modules="all-linear")).eval()
    ids, mask = batch(tok)
    gc = config(tok, [len(tok) + 7], new=6)
    loop = cpu_loop(kernels="auto")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert loop.generate(model, ids, mask, gc).token_ids == \
                hf_completions(model, ids, mask, gc)
    lines = [r.getMessage() for r in caplog.records if "projections through" in r.getMessage()]
    assert len(lines) == 1 and "0 of 14 projections" in lines[0], lines
    assert "variant" in lines[0]  # the reason: a LoRA variant (DoRA)
    assert kernels_on_cpu["projections"] == 0 and kernels_on_cpu["add_rmsnorm"] > 0


def test_failing_kernels_turn_off_with_one_line(tok, kernels_on_cpu, caplog, monkeypatch):
    """A kernel that raises in the first-call check turns the kernels off for the run (one
    logged line); the loop goes on without them and its completions equal HF's."""
    from trainers.sampling import model_step

    def broken(x, module, **kw):
        raise RuntimeError("forced kernel failure")

    monkeypatch.setattr(model_step, "decode_linear", broken)
    model = build(tok, "llama", lora=True)
    ids, mask = batch(tok)
    gc = config(tok, [len(tok) + 7], new=6)
    loop = cpu_loop(kernels="auto")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert loop.generate(model, ids, mask, gc).token_ids == \
                hf_completions(model, ids, mask, gc)
    assert loop.disabled_reason is None and loop.kernels == "torch"
    lines = [r.getMessage() for r in caplog.records if "kernels off for the run" in
             r.getMessage()]
    assert len(lines) == 1 and "forced kernel failure" in lines[0], lines


LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # Llama-3.2's config.json


# an interpreted loop run each: Llama in the default suite, the other families slow
@pytest.mark.parametrize("family", ["llama"] + [pytest.param(f, marks=pytest.mark.slow) for f in
                                               ("llama3", "qwen2", "qwen3", "mistral")])
def test_greedy_with_kernels_equals_hf_generate(tok, family, kernels_on_cpu, caplog):
    """kernels="auto" on the fp32 tiny models + LoRA (dense projections through decode_linear,
    add_rmsnorm, and each decode step's RoPE + cache write through rope_cache_write, Qwen3's q/k
    norms fused): greedy completions token-identical to HF `generate`; Llama with Llama-3.2's
    rope scaling, Qwen2 / Mistral with sliding windows. q and k weights scaled up (scores x 36),
    so attention is peaked and a wrong rotation changes the tokens."""
    kw = {"rope_parameters": LLAMA32_ROPE} if family == "llama3" else {}
    model = build(tok, "llama" if family == "llama3" else family, **kw)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    model = with_lora(model, seed=0)
    if family == "llama3":
        assert model.get_base_model().model.rotary_emb.rope_type == "llama3"
    ids, mask = batch(tok)
    gc = config(tok, [len(tok) + 7], new=8)
    loop = cpu_loop(kernels="auto")
    with caplog.at_level(logging.WARNING):
        out = loop.generate(model, ids, mask, gc)
    assert loop.disabled_reason is None and loop.kernels == "auto" and out is not None
    assert out.token_ids == hf_completions(model, ids, mask, gc)
    lines = [r.getMessage() for r in caplog.records if "projections through" in r.getMessage()]
    assert len(lines) == 1 and "RoPE + cache write by rope_cache_write" in lines[0], lines
    assert ("q/k norm + RoPE" in lines[0]) == (family == "qwen3")
    # these fp32 models keep RoPE in its own launch (the fused one rotates 16-bit values:
    # test_kernel_forward_equals_the_modules runs it); 2 layers, every decode step
    assert "with RoPE and the cache write in its launch" not in lines[0], lines
    assert kernels_on_cpu["rope_cache_write"] >= 2 * 7


def test_rope_plan_leaves_partial_rotary_to_torch(tok):
    """A rotary dim below the head dim (transformers' Llama attention cannot run it, but a config
    can ask for it) keeps RoPE on the torch ops, with the reason in the plan's line; the other
    kernels stay on."""
    from trainers.sampling import kernel_plan

    partial = build(tok, "llama", rope_parameters={"rope_type": "linear", "factor": 1.0,
                                                   "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    full = build(tok, "llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_plan, "KERNEL_DEVICES", ("cuda", "cpu"))
        plan = kernel_plan.make_plan(partial, "auto", "cpu")
        assert not plan.rope and plan.norms and plan.active
        assert "RoPE by torch ops (rotary dim 8 != head dim 16 (partial rotary))" in plan.line
        assert kernel_plan.make_plan(full, "auto", "cpu").rope
    assert not kernel_plan.make_plan(full, "torch", "cpu").rope


def test_kernels_option_is_checked():
    with pytest.raises(ValueError, match="kernels='triton'"):
        DecodeLoop(kernels="triton")


# -- GPU: captured graphs ---------------------------------------------------------------------

def _gpu_llama(dtype=torch.bfloat16, *, vocab=512, seed=0, family="llama"):
    """A small random model of `family` (llama; qwen2: q/k/v biases; qwen3: q/k norms; mistral:
    a sliding window of 16, shorter than most prompts plus completions), GQA 8/2 heads, head_dim
    64, untied head at std 0.2: logits of a few units, so greedy choices are rarely decided by
    bf16 rounding."""
    config_cls, model_cls, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 64}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 16, "head_dim": 64}),
    }[family]
    config = config_cls(vocab_size=vocab, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2, tie_word_embeddings=False, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        model.get_input_embeddings().weight.data.normal_(0.0, 1.0)
        model.get_output_embeddings().weight.data.normal_(0.0, 0.2)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3: norms that matter
                p.data.uniform_(0.5, 1.5)
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):  # Qwen2's biases
                p.data.normal_(0.0, 0.5)
    return model.to("cuda", dtype).eval()


def _gpu_prompts(vocab, batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (batch,), generator=g)
    P = int(lengths.max())
    ids = torch.randint(3, vocab, (batch, P), generator=g)
    mask = (torch.arange(P)[None] >= (P - lengths)[:, None]).long()
    return (ids * mask).cuda(), mask.cuda()


def _greedy_gap(model, ids, mask, ours, theirs):
    """For rows whose greedy tokens diverge: (row, step, gap, variation, zmax) at the first
    divergence: the eager batch-1 logit gap z[theirs] - z[ours] between the two choices,
    eager's own change of the logits between batch 1 and the batch (max over the vocabulary),
    and max |z| of the row."""
    report = []
    for b, (o, t) in enumerate(zip(ours, theirs)):
        if o == t:
            continue
        k = next((i for i, (x, y) in enumerate(zip(o, t)) if x != y), min(len(o), len(t)))
        if k >= min(len(o), len(t)):
            report.append((b, k, 0.0, 0.0, 0.0))
            continue
        prefix = torch.tensor(t[:k], device=ids.device, dtype=ids.dtype)
        row = torch.cat([ids[b][mask[b].bool()], prefix])[None]
        with torch.no_grad():
            z1 = model(input_ids=row).logits[0, -1].float()
            zb = model(input_ids=row.expand(ids.shape[0], -1)).logits[-1, -1].float()
        report.append((b, k, (z1[t[k]] - z1[o[k]]).item(), (z1 - zb).abs().max().item(),
                       z1.abs().max().item()))
    return report


def _bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits): 2^(e - 7) for |x| in [2^e,
    2^(e+1)), at most 2^-7 |x|."""
    return 2.0 ** (math.frexp(max(abs(x), 2.0**-126))[1] - 8)


def _near_tie(gap, variation, zmax, layers):
    """A greedy divergence that bf16 rounding explains: the eager gap between the two tokens is
    within (a) what rounding can move a logit, or (b) eager's own batch-size variation.

    (a) Both forwards sum the same products in different orders (other GEMM shapes, masked SDPA
    over the static cache, our kernels); each rounds its results to bf16. A different fp32 sum
    can land one bf16 ulp away after rounding, and the residual stream carries it: each of the
    2L residual adds (attention and MLP of every layer) rounds to the ulp of the residual, the
    final norm and the head's bf16 output add one rounding each, so the final hidden state
    differs by up to (2L + 2) ulps relative, and a logit z = w·n by about as many ulps of the
    logits' own scale, max |z| (the perturbation of n has random signs: its effect on a logit
    is of the size of a typical logit times that relative error, below max |z| times it).
    Two logits can move in opposite directions: 2 · (2L + 2) · ulp(max |z|).
    (b) eager's own logits change by `variation` between batch 1 and the batch (other GEMM
    tilings); a gap within twice that is a tie eager itself does not decide.
    The test keeps its teeth: a wrong position, mask or cache slot changes the logits by their
    own size, and the token it picks then sits a few standard deviations of the logits (about
    max |z| / 3) below eager's choice, far outside both bounds."""
    return abs(gap) <= max(2 * (2 * layers + 2) * _bf16_ulp(zmax), 2 * variation)


def test_near_tie_bound_scales_with_the_logits():
    """The GPU test's divergence bound: one bf16 ulp of a logit in [8, 16) is 2^-4, so a gap of
    one ulp passes at max |z| = 14 with no batch variation, while a gap of a third of the logits'
    scale (what a broken forward gives) fails; eager's batch variation is the other way in."""
    assert _bf16_ulp(14.0) == 2.0**-4 and _bf16_ulp(1.0) == 2.0**-7
    assert _near_tie(0.0625, 0.0, 14.0, layers=4)
    assert not _near_tie(14.0 / 3, 0.0, 14.0, layers=4)
    assert _near_tie(14.0 / 3, 2.5, 14.0, layers=4)


def _ws_qkv_launches() -> int:
    """Grouped q/k/v launches of the warp-specialized decode linear so far."""
    return sum(v for key, v in linear4bit_ws.LAUNCHES.items() if key.endswith("x3"))


def gpu_lora_llama(quant: str, tmp_path, family: str = "llama"):
    """`_gpu_llama(family=)` in bf16 or loaded from `tmp_path` with a 4-bit base ("nf4" with
    double quant, or "fp4"), with LoRA on every linear layer and random B (std 0.02, seed 1),
    so the adapter matters: r=8, or for Qwen2 r=16 with the factors in bf16 as TRL casts
    QLoRA adapters (what the warp-specialized decode linear takes, so its q/k/v with their
    biases run there)."""
    from peft import LoraConfig, get_peft_model

    model = _gpu_llama(family=family)
    if quant in ("nf4", "fp4"):
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        model.save_pretrained(tmp_path)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=(
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant,
                               bnb_4bit_use_double_quant=quant == "nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16)),
            dtype=torch.bfloat16, device_map={"": 0}).eval()
    torch.manual_seed(1)
    rank = 16 if family == "qwen2" else 8
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                             target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, 0.02)
        if family == "qwen2" and "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant,kernels,family", [
    ("bf16", "auto", "llama"), ("nf4", "torch", "llama"), ("nf4", "auto", "llama"),
    ("fp4", "auto", "llama"), ("nf4", "auto", "qwen3"), ("nf4", "auto", "qwen2"),
    ("nf4", "auto", "mistral"), ("bf16", "torch", "mistral")])
def test_gpu_greedy_and_replay_after_optimizer_step(quant, kernels, family, tmp_path):
    """Greedy completions of the captured loop against eager `generate` (bf16 / NF4 / FP4 +
    LoRA; Llama, Qwen3, Qwen2 with its q/k/v biases, Mistral with its sliding window; decode
    kernels on, attention by decode_attention, or off, attention by SDPA), then an optimizer
    step on the LoRA weights: the replayed graphs (no new capture) give the updated
    policy's greedy tokens (the 4-bit kernel reads the LoRA factors live). One host check per
    k tokens."""
    model = gpu_lora_llama(quant, tmp_path, family)
    ids, mask = _gpu_prompts(512)
    N, k = 48, 16
    gc = GenerationConfig(max_new_tokens=N, do_sample=False, pad_token_id=0, eos_token_id=[1])
    loop = DecodeLoop(check_every=k, kernels=kernels)
    qkv_launches = _ws_qkv_launches()
    t_given = linear4bit_ws.LAUNCHES["lora t given"]
    fused_attention = decode_attention.LAUNCHES["rope_attention"]
    out = loop.generate(model, ids, mask, gc)
    assert loop.disabled_reason is None and out is not None and loop.stats.captures == 1
    assert loop.kernels == kernels  # the kernels passed the first-call check
    (plan,) = loop._plans.values()
    if family == "qwen2" and quant == "nf4":  # q/k/v with their biases on the ws kernel
        assert _ws_qkv_launches() > qkv_launches, dict(linear4bit_ws.LAUNCHES)
        # rank-16 bf16 factors: every gate/up launch takes t from its norm (LORA_T_GROUPS)
        assert len(plan.lora_t) == 4, plan.line
        assert linear4bit_ws.LAUNCHES["lora t given"] > t_given, dict(linear4bit_ws.LAUNCHES)
    print(f"\n{family} {quant} kernels={kernels}: {plan.line}")
    if kernels == "auto":
        packed = 28 if quant in ("nf4", "fp4") else 0  # 4 layers x 7 projections
        assert plan.norms and plan.rope and f"28 of 28 projections through decode_linear " \
            f"({packed} by" in plan.line, plan.line
        assert len(plan.groups) == (8 if packed else 0), plan.line  # q/k/v, gate/up x 4
        assert len(plan.silu_mul) == (4 if packed else 0), plan.line
        assert plan.head and "LM head by head_logits" in plan.line, plan.line
        assert plan.attention and "attention by decode_attention" in plan.line, plan.line
        # RoPE and the cache write in the attention's launch, but for Qwen3's q/k norms
        assert plan.rope_attention == (family != "qwen3"), plan.line
        assert (decode_attention.LAUNCHES["rope_attention"] > fused_attention) == \
            plan.rope_attention, dict(decode_attention.LAUNCHES)
    ref = hf_completions(model, ids, mask, gc)
    gaps = _greedy_gap(model, ids, mask, out.token_ids, ref)
    print(f"\n{quant} kernels={kernels}: rows diverging from eager (row, step, eager logit gap, "
          f"eager batch variation, max |z|): {gaps}; capture {loop.stats.capture_s:.2f} s, first token "
          f"{loop.stats.first_token_s:.2f} s")
    layers = model.get_base_model().config.num_hidden_layers
    assert all(_near_tie(*g[2:], layers) for g in gaps), gaps  # rounding near-ties only
    assert loop.stats.host_checks <= math.ceil((N - 1) / k) + 1
    shorter = (ids[:, 5:], mask[:, 5:])  # same batch, shorter prompts: the same graph replays
    short_out = loop.generate(model, *shorter, gc)
    assert loop.stats.captures == 1
    gaps = _greedy_gap(model, *shorter, short_out.token_ids, hf_completions(model, *shorter, gc))
    assert all(_near_tie(*g[2:], layers) for g in gaps), gaps

    # one optimizer step on the LoRA weights, large enough to change the greedy completions
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.SGD(params, lr=5.0)
    seq = torch.cat([ids, torch.randint(3, 512, (ids.shape[0], 8), device="cuda")], 1)
    loss = model(input_ids=seq, attention_mask=torch.ones_like(seq), labels=seq).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    after_ref = hf_completions(model, ids, mask, gc)
    assert after_ref != ref
    after = loop.generate(model, ids, mask, gc)
    assert loop.stats.captures == 1  # replayed, not recaptured
    gaps = _greedy_gap(model, ids, mask, after.token_ids, after_ref)
    assert all(_near_tie(*g[2:], layers) for g in gaps), gaps
    assert sum(a == b for a, b in zip(after.token_ids, after_ref)) >= len(after_ref) // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_loop_keeps_only_its_cache_and_state(tmp_path):
    """What the captured loop leaves allocated between calls (NF4 + LoRA, kernels on): its KV
    cache, its row state and RoPE tables, and small buffers (the 4-bit kernel's tile counters,
    EOS ids): under 1 MiB besides the cache and the state. No cuBLAS call is captured (the
    head is `head_logits`, RoPE a table lookup), so no cuBLAS workspace is kept for the
    capture stream (torch's is 32 MiB on Hopper, at least 4 MiB elsewhere); a second call and
    a second loop add nothing more than their own cache and state."""
    model = gpu_lora_llama("nf4", tmp_path)
    ids, mask = _gpu_prompts(512)
    gc = GenerationConfig(max_new_tokens=32, do_sample=True, pad_token_id=0, eos_token_id=[1])
    with torch.no_grad():  # what training leaves: the default stream's own cuBLAS workspace
        model(input_ids=ids, attention_mask=mask)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    kept, loops = [], []
    for _ in range(2):
        loop = DecodeLoop(check_every=8)
        loops.append(loop)  # both stay alive: the second adds to what the first keeps
        for _ in range(2):
            assert loop.generate(model, ids, mask, gc) is not None
        assert loop.disabled_reason is None and loop.stats.captures == 1
        (plan,) = loop._plans.values()
        assert plan.head, plan.line
        torch.cuda.synchronize()
        own = sum(c.nbytes() for c in loop._caches.values()) + sum(
            t.nbytes for st in loop._states.values() for t in st.tensors())
        kept.append((torch.cuda.memory_allocated() - base - own, own))
        base += own + kept[-1][0]
    assert all(extra < 2**20 for extra, _ in kept), kept


def test_attention_plan_needs_a_power_of_two_head_dim(tok):
    """decode_attention's tiles need a power-of-two head dim >= 16: another head dim keeps the
    decode step's attention on SDPA, with the reason in the plan's line; kernels="torch" never
    plans it."""
    from trainers.sampling import kernel_plan

    odd = build(tok, "llama", head_dim=24)
    full = build(tok, "llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_plan, "KERNEL_DEVICES", ("cuda", "cpu"))
        plan = kernel_plan.make_plan(odd, "auto", "cpu")
        assert not plan.attention and plan.rope and plan.active, plan.line
        assert "attention by SDPA over the cache (head dim 24 is not a power of two" in plan.line
        plan = kernel_plan.make_plan(full, "auto", "cpu")
        assert plan.attention and "; attention by decode_attention;" in plan.line, plan.line
    assert not kernel_plan.make_plan(full, "torch", "cpu").attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pdl_launches_change_no_token(tmp_path, monkeypatch):
    """The captured loop with the decode kernels launched by programmatic dependent launch
    (kernels.pdl) and without (GRPO_LCE_PDL=0), NF4 + LoRA, greedy and seeded sampling: the same
    tokens and the same log-probs bit for bit (PDL moves when a kernel starts, never what it
    computes), and every decode kernel of the step did launch with PDL, the 4-bit linear also
    letting the next kernel start after its K loop."""
    from trainers.sampling.kernels import pdl

    with pdl.decode_step():  # where the loop launches with PDL
        reason = pdl.pdl_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"no PDL here: {reason}")
    model = gpu_lora_llama("nf4", tmp_path)
    ids, mask = _gpu_prompts(512)
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, env)
        pdl.LAUNCHES.clear()
        loop = DecodeLoop(check_every=16)
        for sample in (False, True):
            gc = GenerationConfig(max_new_tokens=40, do_sample=sample, pad_token_id=0,
                                  eos_token_id=[1])
            torch.manual_seed(3)
            out = loop.generate(model, ids, mask, gc)
            assert loop.disabled_reason is None and out is not None
            runs[env, sample] = (out.token_ids, out.logprobs)
        (plan,) = loop._plans.values()
        assert plan.head and plan.attention and plan.rope and plan.norms, plan.line
        launched = dict(pdl.LAUNCHES)
        if env == "0":
            assert not launched, launched
        else:
            # RoPE, the cache write and attention in one launch (this model has no q/k norms)
            assert plan.rope_attention, plan.line
            assert set(launched) >= {"_linear4bit_lora_kernel", "_add_rmsnorm_kernel",
                                     "_rope_attention_kernel",
                                     "_head_logits_kernel", "_chunk_lse_kernel",
                                     "_chunk_race_kernel", "_pick_kernel",
                                     "_linear4bit_lora_kernel early next"}, launched
    for sample in (False, True):
        assert runs["1", sample] == runs["0", sample], sample
