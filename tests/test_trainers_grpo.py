"""trainers.GRPOTrainer against stock trl.GRPOTrainer 1.16 on tiny offline fp32 Llamas.

Covers: per-token log-probs and entropy (policy, adapter-disabled reference, separate reference
model), loss, metrics and gradients after one `compute_loss` + backward for the grpo / dapo /
dr_grpo / bnpo losses with β = 0 and β > 0, token and sequence importance sampling, τ ≠ 1,
tied and untied embeddings, LoRA and full fine-tuning; a 2-step `train()` whose logs match
stock TRL step by step; the fallback to TRL's head; and the errors for unsupported setups.

Every comparison runs ours inside `_trainer_pairs.fused_head_ran`, so it fails if ours fell back
to TRL's code (check: `PYTHONPATH=tests python -m pytest -p _force_fallback ...`,
tests/_force_fallback.py). Under that mutation only the refusals, the version checks,
`unwrap_model` and the packing options' checks pass: they stop at construction or run no
log-prob pass, so they need no head.

    python -m pytest tests/test_trainers_grpo.py -q

Tolerances. Everything runs in fp32 (bf16=False; TRL's config defaults to bf16 autocast), and
both trainers see bit-identical hidden states (same weights, same forward), so the only
difference is the head: TRL's chunked log-softmax versus grpo_lce's, both fp32, with different
summation orders. Log-probs: an H-term fp32 dot product per logit, Σ|h_i w_i| ≲ 20 at H = 64,
so tests/_tolerance.py's sum_bound(64, 20) ≈ 8e-5 per logit is the 4σ rounding; atol 5e-5 on
log-probs and entropies (an lse and the logit each move by about one such error, of either sign).
Losses and gradients: within 3× of stock's own distance to the same step on the fp64 model
(`assert_loss_vs_fp64`, `assert_grads_vs_fp64`), a bound that grows with the depth and the sum
lengths of the backward as the rounding does, on any machine and thread count.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import trl
from _tiny_models import lora_tiny_llama as _model
from _tolerance import _log, assert_grads_vs_fp64, assert_loss_vs_fp64, in_fp64
from _trainer_pairs import fused_head_ran, fused_if_ours, ragged_ids_and_mask
from datasets import Dataset
from peft import LoraConfig
from trl.trainer.utils import use_adapter

from trainers import GRPOTrainer
from trainers.head import check_fused_head, forward_hidden_states, lm_head_params
from trainers.tiny import build_tiny_llama, build_tokenizer, tiny_model_dir

LOGP_ATOL = 5e-5

B, P, C = 4, 6, 9  # completions, prompt length, completion length (ragged via masks below)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _dataset():
    return Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z", "7-2=", "hi!"] * 4})


def _config(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=B, num_generations=B, max_completion_length=C,
        logging_steps=1, save_strategy="no", seed=0,
    )
    kw.update(overrides)
    return trl.GRPOConfig(**kw)


def _pair(tok, tmp_path, model, **config):
    """(stock, ours) on identical copies of `model`, ready for a direct compute_loss call."""
    args = _config(tmp_path, **config)
    out = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        tr = cls(
            model=copy.deepcopy(model), reward_funcs=[_reward_len, _reward_digits], args=args,
            train_dataset=_dataset(), processing_class=tok,
        )
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
        out.append(tr)
    return out


def _ids_and_mask(tok):
    return ragged_ids_and_mask(tok, P, C)  # (B, P + C), B = 4


def _inputs(tok, stock, *, old_noise=0.3, with_ref=False, batch=None):
    """The dict `_generate_and_score_completions` hands to `_compute_loss`. Old log-probs are
    the current ones plus noise (as after an optimizer step), so ratios leave the clip range.
    `batch`: (ids, mask, completion length) in that layout; default `_ids_and_mask(tok)`."""
    ids, mask, c = batch if batch is not None else (*_ids_and_mask(tok), C)
    b, p = ids.shape[0], ids.shape[1] - c
    g = torch.Generator().manual_seed(7)
    inputs = {
        "prompt_ids": ids[:, :p], "prompt_mask": mask[:, :p],
        "completion_ids": ids[:, p:], "completion_mask": mask[:, p:],
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": mask[:, p:].sum(),
    }
    with torch.no_grad():
        logps, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, c)
        inputs["old_per_token_logps"] = logps + old_noise * torch.randn(b, c, generator=g)
        if with_ref:
            inputs["ref_per_token_logps"] = logps + 0.5 * torch.randn(b, c, generator=g)
    return inputs


def _assert_close(ours, ref, *, atol=0.0, rtol=0.0, what=""):
    err = (ours.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs().max().item()
    _log(what, err.max().item(), bound)
    assert err.max().item() <= bound, (
        f"{what}: max err {err.max().item():.3e} > {bound:.3e} at {tuple(err.argmax().tolist())}"
        if err.dim() == 0 else
        f"{what}: max err {err.max().item():.3e} > {bound:.3e} at flat index {int(err.argmax())}"
    )


# ---------------------------------------------------------------- per-token log-probs & entropy

def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _fp64_reference(model, ids, mask, temperature, c=C):
    """log p, entropy of the c completion tokens from logits built in fp64, and max |logit|."""
    hidden, _ = forward_hidden_states(model, input_ids=ids, attention_mask=mask)
    weight, _ = lm_head_params(model)
    z = hidden[:, -c - 1:-1].double() @ weight.double().T / temperature  # (B, c, V) fp64
    logp_all = torch.log_softmax(z, -1)
    keep = mask[:, -c:].bool()
    logp = logp_all.gather(-1, ids[:, -c:, None]).squeeze(-1) * keep
    ent = -(logp_all.exp() * logp_all).sum(-1) * keep
    return logp, ent, z.abs().max().item()



@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logps_entropy_policy_and_reference_match_trl(tok, tmp_path, tied, temperature):
    stock, ours = _pair(tok, tmp_path, _model(tok, tied=tied), temperature=temperature)
    ids, mask = _ids_and_mask(tok)
    ours_lp = {}
    for adapter in ("default", None):  # the policy, then the reference (adapter disabled)
        results = []
        for tr in (stock, ours):
            ctx = use_adapter(tr.model, adapter_name=None) if adapter is None else nullcontext()
            with ctx, fused_if_ours(tr):
                results.append(tr._get_per_token_logps_and_entropies(
                    tr.model, ids, mask, C, batch_size=3, compute_entropy=True))  # ragged chunks
        (lp_s, ent_s, _), (lp_o, ent_o, _) = results
        assert lp_o.shape == (B, C) and lp_o.dtype == torch.float32
        _assert_close(lp_o, lp_s, atol=LOGP_ATOL, what=f"logp adapter={adapter}")
        _assert_close(ent_o, ent_s, atol=LOGP_ATOL, what=f"entropy adapter={adapter}")
        with torch.no_grad(), use_adapter(ours.model, None) if adapter is None else nullcontext():
            lp_64, ent_64, z_max = _fp64_reference(ours.model, ids, mask, temperature)
        # Three-way: ours vs fp64 within k=1.5 of TRL's fp32 error (summation-order noise), plus
        # a floor. grpo_lce forms H = lse − Σ p z, which cancels, so its fp32 entropy error is a
        # few ulp of max|z| rather than of H (TRL's −Σ p log p is ~5× tighter here); the floor
        # 32 ulp · max|z| (~1e-4 relative to H) is far below anything a loss can see.
        eps = torch.finfo(torch.float32).eps
        for name, o, s_, r, floor in (
            ("logp", lp_o, lp_s, lp_64, 2e-6), ("entropy", ent_o, ent_s, ent_64, 32 * eps * z_max)
        ):
            e_o, e_s = _max_err(o, r), _max_err(s_, r)
            assert e_o <= 1.5 * e_s + floor, (
                f"{name} adapter={adapter}: |ours - fp64| {e_o:.2e}, |trl - fp64| {e_s:.2e}")
        # masked completion positions are exactly 0, as TRL returns them
        assert (lp_o[mask[:, P:] == 0] == 0).all() and (ent_o[mask[:, P:] == 0] == 0).all()
        ours_lp[adapter] = lp_o
    # the reference pass really ran without the adapter
    assert (ours_lp["default"] - ours_lp[None]).abs().max() > 1e-3


def test_separate_reference_model_matches_trl(tok, tmp_path):
    # Full fine-tuning with β > 0: TRL builds `ref_model` as a second model; both of its
    # log-prob passes (ours and TRL's) must agree.
    # TRL loads the reference from the policy's path, so the policy is given as a saved model.
    path = tiny_model_dir(str(tmp_path / "tiny"), hidden_size=64, tie_word_embeddings=False)
    stock, ours = _pair(tok, tmp_path, path, beta=0.1)
    assert stock.ref_model is not None and ours.ref_model is not None
    ids, mask = _ids_and_mask(tok)
    with torch.no_grad():
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.ref_model, ids, mask, C)
        with fused_head_ran(ours):
            lp_o, _, _ = ours._get_per_token_logps_and_entropies(ours.ref_model, ids, mask, C)
    _assert_close(lp_o, lp_s, atol=LOGP_ATOL, what="ref_model logp")


# ---------------------------------------------------------------- loss, metrics and gradients

_LOSS_CASES = [
    # loss_type, beta, importance_sampling_level, temperature, tied, extra config
    ("grpo", 0.0, "token", 1.0, True, {}),
    ("grpo", 0.04, "sequence", 0.7, False, {}),
    ("dapo", 0.0, "sequence", 1.0, False, {}),
    ("dapo", 0.04, "token", 0.7, True, {"epsilon_high": 0.28, "delta": 1.5}),
    ("dr_grpo", 0.04, "token", 1.0, False, {}),
    ("dr_grpo", 0.0, "sequence", 0.7, True, {}),
    ("bnpo", 0.04, "sequence", 1.0, True, {}),
    ("bnpo", 0.0, "token", 0.7, False, {"top_entropy_quantile": 0.5, "entropy_coef": 0.05}),
]


def _assert_losses_and_grads(inputs, ours, stock, ref):
    """(loss, grads) of ours and stock in fp32 against stock's on the fp64 model: within
    K_REORDERED of stock's own error (tests/_tolerance.py). The loss averages the completion
    tokens' terms, each O(max|A|) (ratios near 1, KL terms below 1)."""
    (loss_o, g_o), (loss_s, g_s), (loss_r, g_r) = ours, stock, ref
    assert_loss_vs_fp64(loss_o, loss_s, loss_r, n_terms=int(inputs["completion_mask"].sum()),
                        term=inputs["advantages"].abs().max().item())
    assert_grads_vs_fp64(g_o, g_s, g_r)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_loss(tr, inputs):
    tr.model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(tr.model, inputs)
    loss.backward()
    return loss.detach(), _grads(tr.model), {k: list(v) for k, v in tr._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,beta,level,temperature,tied,extra", _LOSS_CASES)
def test_loss_metrics_and_lora_grads_match_trl(
    tok, tmp_path, loss_type, beta, level, temperature, tied, extra
):
    stock, ours = _pair(
        tok, tmp_path, _model(tok, tied=tied), loss_type=loss_type, beta=beta,
        importance_sampling_level=level, temperature=temperature, **extra,
    )
    inputs = _inputs(tok, stock, with_ref=beta != 0.0)
    loss_s, g_s, m_s = _run_loss(stock, inputs)
    with fused_head_ran(ours):
        loss_o, g_o, m_o = _run_loss(ours, inputs)
    with in_fp64(stock.model):
        loss_r, g_r, _ = _run_loss(stock, inputs)

    _assert_losses_and_grads(inputs, (loss_o, g_o), (loss_s, g_s), (loss_r, g_r))
    assert all("lora_" in n for n in g_s)
    assert m_s.keys() == m_o.keys()
    for k in m_s:
        # abs 2e-5: the entropy floor of the log-prob test (tied tiny models are peaky, H ~ 5e-3)
        assert m_o[k] == pytest.approx(m_s[k], rel=1e-4, abs=2e-5), k
    if level == "token" and beta == 0.0 and loss_type == "grpo":
        assert m_s["clip_ratio/region_mean"][0] > 0  # the clipped branch was exercised


def test_full_finetune_grads_match_trl(tok, tmp_path):
    # No PEFT: the head itself is trainable (tied: the embedding gets the head's gradient too).
    stock, ours = _pair(tok, tmp_path, _model(tok, tied=True, peft=False), beta=0.0,
                        temperature=0.8)
    inputs = _inputs(tok, stock)
    loss_s, g_s, _ = _run_loss(stock, inputs)
    with fused_head_ran(ours):
        loss_o, g_o, _ = _run_loss(ours, inputs)
    with in_fp64(stock.model):
        loss_r, g_r, _ = _run_loss(stock, inputs)
    _assert_losses_and_grads(inputs, (loss_o, g_o), (loss_s, g_s), (loss_r, g_r))
    assert "model.embed_tokens.weight" in g_s


# ---------------------------------------------------------------- a short training run

def _train_logs(cls, tok, tmp_path, model, **config):
    # steps_per_generation=4 > accumulation=2: TRL computes old log-probs (our no-grad path) and
    # step 2 trains off-policy on the buffered half of step 1's generation (ratios ≠ 1);
    # step 3 generates again from the updated adapter.
    args = _config(
        tmp_path, max_steps=3, gradient_accumulation_steps=2, steps_per_generation=4,
        per_device_train_batch_size=2, num_generations=4, learning_rate=5e-3, **config,
    )
    tr = cls(model=copy.deepcopy(model), reward_funcs=[_reward_len, _reward_digits], args=args,
             train_dataset=_dataset(), processing_class=tok)
    torch.manual_seed(0)  # generation samples from the global RNG: same stream for both runs
    with fused_if_ours(tr):
        tr.train()
    return [h for h in tr.state.log_history if "loss" in h]


def test_train_logs_match_trl(tok, tmp_path):
    # Untied: the tied tiny model is so peaky that all samples coincide and the loss is 0.
    model = _model(tok, tied=False)
    cfg = dict(beta=0.04, temperature=1.0, loss_type="dapo")
    logs_s = _train_logs(trl.GRPOTrainer, tok, tmp_path / "s", model, **cfg)
    logs_o = _train_logs(GRPOTrainer, tok, tmp_path / "o", model, **cfg)
    assert len(logs_s) == len(logs_o) == 3
    assert logs_s[0]["reward_std"] > 0 and logs_s[0]["loss"] != 0  # a real learning signal
    for step, (s, o) in enumerate(zip(logs_s, logs_o, strict=True), start=1):
        # ours logs every metric TRL logs, plus the generation time on generation steps
        assert o.keys() - s.keys() == ({"timing/generation_s"} if "reward" in s else set())
        assert s.keys() <= o.keys()
        # sampled completions (hence rewards) are identical, else the comparison would be moot
        if "reward" in s:
            assert o["reward"] == s["reward"]
            assert o["completions/mean_length"] == s["completions/mean_length"]
        for k in s.keys() - {"step_time"}:
            assert o[k] == pytest.approx(s[k], rel=1e-4, abs=2e-5), (step, k, o[k], s[k])


# ---------------------------------------------------------------- fallbacks and errors

def test_softcapped_logits_fall_back_to_trl_head(tok, tmp_path):
    # Llama's forward ignores final_logit_softcapping, TRL's fused head applies it; grpo_lce
    # does not, so ours must hand the call to TRL's head (and say so once).
    model = _model(tok)
    model.get_base_model().config.final_logit_softcapping = 5.0
    _assert_trl_head_serves(tok, tmp_path, model, "final_logit_softcapping")


def _assert_trl_head_serves(tok, tmp_path, model, reason: str):
    """Two log-prob passes of ours equal stock's to the bit (TRL's head served them), with one
    logged fallback line that names `reason`."""
    stock, ours = _pair(tok, tmp_path, model)
    ids, mask = _ids_and_mask(tok)
    with torch.no_grad():
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, C)
        lp_o, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, C)
        ours._get_per_token_logps_and_entropies(ours.model, ids, mask, C)
    assert torch.equal(lp_o, lp_s)
    assert len(ours._lce_fallbacks_logged) == 1
    assert reason in next(iter(ours._lce_fallbacks_logged))


def test_float64_model_falls_back_to_trl_head(tok, tmp_path):
    # grpo_lce computes in fp32 / bf16 / fp16: a float64 model's calls go to TRL's head, with
    # one logged line naming the dtype, instead of an error from inside the op
    _assert_trl_head_serves(tok, tmp_path, _model(tok).double(), "torch.float64")


def _construct(tok, tmp_path, model, peft_config=None):
    return GRPOTrainer(model=model, reward_funcs=_reward_len, args=_config(tmp_path),
                       train_dataset=_dataset(), processing_class=tok, peft_config=peft_config)


def test_lora_target_on_lm_head_is_refused(tok, tmp_path):
    cfg = LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        _construct(tok, tmp_path, _model(tok, tied=False, peft=False), peft_config=cfg)


def test_modules_to_save_lm_head_is_refused(tok, tmp_path):
    cfg = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="modules_to_save"):
        _construct(tok, tmp_path, _model(tok, tied=False, peft=False), peft_config=cfg)


def test_quantized_lm_head_is_refused(tok):
    model = _model(tok, tied=False, peft=False)
    # stands in for a bitsandbytes Params4bit: packed uint8 storage
    model.lm_head.weight = torch.nn.Parameter(
        torch.zeros(model.lm_head.weight.numel() // 2, 1, dtype=torch.uint8), requires_grad=False
    )
    with pytest.raises(ValueError, match="quantized"):
        check_fused_head(model)


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0.dev0"])
def test_unsupported_trl_version_is_refused(tok, tmp_path, monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(RuntimeError, match=r"trl>=1\.16,<1\.17.*" + version.replace(".", r"\.")):
        _construct(tok, tmp_path, _model(tok, peft=False))


def test_supported_prerelease_accepted(monkeypatch):
    from trainers._version import check_trl_version

    monkeypatch.setattr(trl, "__version__", "1.16.1.dev0")
    check_trl_version("GRPOTrainer")


def test_unwrap_model_peels_wrappers_like_accelerate(tok):
    # trainers.models.unwrap_model replaces accelerate's extract_model_from_parallel on the hot
    # path; it must peel the same wrappers (DataParallel, torch.compile), and it also peels a
    # compiled module inside DataParallel, which accelerate leaves compiled. PEFT on top.
    from accelerate.utils import extract_model_from_parallel
    from peft import LoraConfig, get_peft_model

    from trainers.models import unwrap_causal_lm, unwrap_model

    model = build_tiny_llama(tok, hidden_size=32, num_layers=1)
    for wrapped in (model, torch.nn.DataParallel(model), torch.compile(model)):
        assert unwrap_model(wrapped) is model
        assert extract_model_from_parallel(wrapped, keep_torch_compile=False) is model
    assert unwrap_model(torch.nn.DataParallel(torch.compile(model))) is model
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert unwrap_causal_lm(torch.nn.DataParallel(peft)) is model


def test_packing_options_are_checked_on_set(tok, tmp_path):
    # from the config at construction, then set on the trainer: checked both times
    from trainers import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=B, num_generations=B, packing="false",
                      max_packed_tokens=32)
    tr = GRPOTrainer(model=_model(tok, peft=False), reward_funcs=_reward_len, args=args,
                     train_dataset=_dataset(), processing_class=tok)
    assert tr.packing is False and tr.max_packed_tokens == 32
    tr.packing = "AUTO"
    assert tr.packing == "auto"
    with pytest.raises(ValueError, match=r"packing must be True, False or 'auto', got 'bogus'"):
        tr.packing = "bogus"
    with pytest.raises(ValueError, match=r"max_packed_tokens must be a positive int or None, "
                                         r"got -1"):
        tr.max_packed_tokens = -1
    assert tr.packing == "auto" and tr.max_packed_tokens == 32
