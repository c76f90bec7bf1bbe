"""trainers.DPOTrainer and KTOTrainer in bf16 on one GPU: ours, TRL's fused head and fp64.

A Llama-shaped model (hidden 1024, 2 layers, vocabulary 128256, tied embeddings, bf16 weights,
LoRA r=16 on every linear layer, its B matrices random after construction so the policy differs
from its reference, TRL's copy of the initial adapter; bf16 autocast as `bf16=True` sets it)
and one batch of 8 preference pairs (DPO) / 8 labelled completions (KTO). Both trainers run the same
`compute_loss` + backward on identical copies; every fused-head call is recorded with the
backbone's hidden states it scored, and the fp64 reference recomputes that call's per-token
log-probs from the same hidden states and head weight with fp64 logits. Then

    err(ours) = max |log_probs(ours) − fp64|,  err(trl) likewise, per token and per sequence

and ours must be at least 10× closer to fp64 than TRL's head, whose logits are bf16 tiles (one
bf16 rounding of every logit, 2^-9 relative, ~1e-2 on a log-prob at |z| ~ 10), while ours are
fp32 from bf16 operands (a few fp32 ulp). The loss is then recomputed in fp64 from the fp64
per-sequence log-probs (DPO's sigmoid loss; KTO's loss with its clamped KL estimate), and ours
must be closer to it than TRL's.

Those two runs are padded (`packing=False`), so the recorded hidden states line up with the
labels. A third test runs DPO with the default `packing="auto"`, which on CUDA in bf16 packs
through PyTorch's varlen FlashAttention: it must pack and stay within bf16 noise of the padded
run (on CPU in bf16 with a dense mask: mean |Δ logp| 1.8e-3, loss 7e-4 relative).

    python -m pytest tests/test_trainers_pref_gpu.py -q -s     # -s prints the errors

Skipped without CUDA (conftest). The same checks run on CPU in bf16 with a 4096-token
vocabulary (`_check_dpo(tmp_path, "cpu", 4096)`): ours 1.3e-6 per token and 6e-6 per sequence
from fp64, TRL's head 2e-2 and 4e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import trl
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from trainers import DPOTrainer, KTOTrainer
from trainers.models import unwrap_causal_lm
from trainers.tiny import build_tokenizer
from _trainer_pairs import randomize_adapter

pytestmark = pytest.mark.gpu

VOCAB = 128256
BETA = 0.5
# ours must be this many times closer to fp64 than TRL's bf16-logit head
GAIN = 10.0


def _model(tok, device, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        # std 0.05 embeddings (the tied head): logits of O(10) at H = 1024, a peaked softmax
        model.get_input_embeddings().weight.data.normal_(0.0, 0.05)
        model = model.to(torch.bfloat16)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return model


def _words(n, seed):
    g = torch.Generator().manual_seed(seed)
    chars = "abcdefghij klmnop 0123456789+-*="
    return ["".join(chars[i] for i in torch.randint(0, len(chars), (int(k),), generator=g))
            for k in torch.randint(8, 60, (n,), generator=g)]


class _Recorder:
    """Wraps the fused forward of a causal LM (whichever is installed) and the backbone's
    output: for every `fused_lm_head=True` call, (hidden (B, L, H), labels, log_probs)."""

    def __init__(self, lm):
        self.calls, self._hidden = [], []
        inner = lm.__dict__["forward"]

        def forward(*args, fused_lm_head=False, labels=None, **kwargs):
            out = inner(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)
            if fused_lm_head:
                self.calls.append((self._hidden[-1], labels, out.log_probs.detach()))
            return out

        lm.forward = forward
        lm.base_model.register_forward_hook(
            lambda _m, _a, out: self._hidden.append(out.last_hidden_state.detach()))


def _fp64_log_probs(lm, hidden, labels):
    head = lm.get_output_embeddings()
    w = head.weight.detach().double()
    y = labels[:, 1:]
    z = hidden[:, :-1].double() @ w.t()  # (B, L-1, V) fp64
    logp = z.log_softmax(-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    return torch.where(y != -100, logp, 0.0)


def _errors(tr, lm_of):
    """(per-token error, per-sequence error, fp64 per-sequence log-probs of every call)."""
    tok_err = seq_err = 0.0
    seqs = []
    for hidden, labels, logp in tr._recorder.calls:
        ref = _fp64_log_probs(lm_of, hidden, labels)
        tok_err = max(tok_err, (logp.double() - ref).abs().max().item())
        seq_err = max(seq_err, (logp.double().sum(1) - ref.sum(1)).abs().max().item())
        seqs.append(ref.sum(1))
    return tok_err, seq_err, seqs


def _run(cls, model, args, dataset, tok, **kwargs):
    tr = cls(model=copy.deepcopy(model), args=args, train_dataset=dataset,
             processing_class=tok, **kwargs)
    randomize_adapter(tr.model, seed=3)  # the policy moves away from its "ref" adapter copy
    tr._recorder = _Recorder(unwrap_causal_lm(tr.model))
    tr.model.train()
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(tr.train_dataset))])
    batch = {k: v.to(tr.accelerator.device) if torch.is_tensor(v) else v
             for k, v in batch.items()}
    with tr.compute_loss_context_manager():
        loss = tr.compute_loss(tr.model, batch)
    loss.backward()
    return tr, loss.detach().double().item()


def _compare(stock, ours, loss_s, loss_o, fp64_loss):
    lm = unwrap_causal_lm(ours.model)
    e_s = _errors(stock, lm)
    e_o = _errors(ours, lm)
    loss_64 = fp64_loss(e_o[2])
    print(f"\nper-token |err|: ours {e_o[0]:.2e}, trl {e_s[0]:.2e};  per-sequence: ours "
          f"{e_o[1]:.2e}, trl {e_s[1]:.2e};  loss: fp64 {loss_64:.6f}, ours {loss_o:.6f}, "
          f"trl {loss_s:.6f}")
    assert e_o[0] * GAIN <= e_s[0], (e_o[0], e_s[0])
    assert e_o[1] * GAIN <= e_s[1], (e_o[1], e_s[1])
    assert abs(loss_o - loss_64) <= abs(loss_s - loss_64) + 1e-6


def _check_dpo(tmp_path, device, vocab):
    tok = build_tokenizer()
    model = _model(tok, device, vocab)
    n = 8
    data = Dataset.from_dict({"prompt": _words(n, 1), "chosen": _words(n, 2),
                              "rejected": _words(n, 3)})
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=True, beta=BETA,
                         per_device_train_batch_size=n, use_cpu=device == "cpu",
                         save_strategy="no")
    stock, loss_s = _run(trl.DPOTrainer, model, args, data, tok)
    # padded, so that the recorded hidden states line up with the labels (packing: below)
    ours, loss_o = _run(DPOTrainer, model, args, data, tok, packing=False)

    def fp64_loss(seqs):  # calls: policy (chosen ‖ rejected), then reference
        pol, ref = seqs
        pc, pr = pol.chunk(2)
        rc, rr = ref.chunk(2)
        return (-F.logsigmoid(BETA * ((pc - rc) - (pr - rr)))).mean().item()

    _compare(stock, ours, loss_s, loss_o, fp64_loss)


def _check_kto(tmp_path, device, vocab):
    tok = build_tokenizer()
    model = _model(tok, device, vocab)
    n = 8
    labels = [True, False, True, True, False, True, False, False]
    data = Dataset.from_dict({"prompt": _words(n, 4), "completion": _words(n, 5),
                              "label": labels})
    args = trl.KTOConfig(output_dir=str(tmp_path), report_to="none", bf16=True, beta=BETA,
                         per_device_train_batch_size=n, use_cpu=device == "cpu",
                         save_strategy="no")
    stock, loss_s = _run(trl.KTOTrainer, model, args, data, tok)
    ours, loss_o = _run(KTOTrainer, model, args, data, tok, packing=False)

    def fp64_loss(seqs):  # calls: policy KL pass, policy, reference KL pass, reference
        kl_pol, pol, kl_ref, ref = seqs
        kl = (kl_pol - kl_ref).mean().clamp(min=0)
        desirable = torch.tensor(labels, device=pol.device)
        ratio = pol - ref
        losses = torch.where(desirable, 1 - torch.sigmoid(BETA * (ratio - kl)),
                             1 - torch.sigmoid(BETA * (kl - ratio)))
        return losses.mean().item()

    _compare(stock, ours, loss_s, loss_o, fp64_loss)


def test_dpo_bf16_closer_to_fp64(tmp_path):
    _check_dpo(tmp_path, "cuda", VOCAB)


def test_kto_bf16_closer_to_fp64(tmp_path):
    _check_kto(tmp_path, "cuda", VOCAB)


def test_dpo_bf16_packs_through_varlen(tmp_path):
    """A smoke test of the CUDA packed path (sdpa switched to PyTorch's varlen FlashAttention,
    trainers.attention) under DPO: it packs, backpropagates, and its log-probs stay within bf16
    noise of the padded pass (the backbone's attention kernel differs, so hidden states differ
    by bf16 roundings; exactness of packing itself is checked in fp32 on CPU,
    tests/test_fused_forward_packing.py)."""
    tok = build_tokenizer()
    model = _model(tok, "cuda", VOCAB)
    n = 8
    data = Dataset.from_dict({"prompt": _words(n, 1), "chosen": _words(n, 2),
                              "rejected": _words(n, 3)})
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to="none", bf16=True, beta=BETA,
                         per_device_train_batch_size=n, save_strategy="no")
    runs = {}
    for packing in (False, "auto"):
        tr, loss = _run(DPOTrainer, model, args, data, tok, packing=packing)
        shapes = [h.shape for h, _, _ in tr._recorder.calls]
        logps = [lp for _, _, lp in tr._recorder.calls]
        runs[packing] = loss, shapes, logps
    (loss_pad, shapes_pad, lp_pad), (loss_pack, shapes_pack, lp_pack) = runs[False], runs["auto"]
    assert all(s[0] == 2 * n for s in shapes_pad) and all(s[0] == 1 for s in shapes_pack)
    for a, b in zip(lp_pad, lp_pack, strict=True):
        diff = (a.float() - b.float()).abs()
        assert diff.mean().item() <= 2e-2, diff.mean().item()
    assert abs(loss_pack - loss_pad) <= 2e-2 * abs(loss_pad) + 1e-3, (loss_pack, loss_pad)
