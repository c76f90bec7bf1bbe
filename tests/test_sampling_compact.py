"""trainers.sampling.loop: compaction of finished rows (`DecodeLoop(compact_finished=True)`).

CPU, tiny random fp32 models (test_sampling_loop's helpers), with the fake-graph capture path
(captured steps hold their tensors weakly, as a CUDA graph holds addresses): greedy completions
with compaction equal those without and HF `generate`'s, on batches whose rows stop at
different lengths (`mid_eos`), over a second call that replays the bucket graphs, with a
repetition penalty (`seen` moves with its row), with a batch that never shrinks and one where a
single row survives; the MAX_CAPTURES bound (no compaction past it); sampled log-probs under
compaction against a recomputation through transformers' processors.

    python -m pytest tests/test_sampling_compact.py -q
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from test_sampling_loop import (
    PROMPTS,
    attention_only,
    batch,
    build,
    config,
    fake_graphs,
    hf_completions,
    mid_eos,
    recompute_logprobs,
    spread_eos,
)

from trainers import tiny
from trainers.sampling import DecodeLoop
from trainers.sampling import loop as loop_module
from trainers.sampling.loop import bucket

NEW = 24
K = 2  # decode steps per graph: host checks often enough for rows to leave in small batches
TEXTS = PROMPTS + ["1+1=", "zz top", "quiet", "on and on and", "b"]  # 10 prompts


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


@pytest.fixture(name="fake_graphs")
def fake_graphs_fixture(monkeypatch):
    """tests/test_sampling_loop.py's fake graphs: the list of the working batch of each capture."""
    return fake_graphs(monkeypatch)


def loops(**kw):
    return (DecodeLoop(devices=("cpu",), check_every=K, **kw),
            DecodeLoop(devices=("cpu",), check_every=K, compact_finished=True, **kw))


def logprob_bound(model, ids, mask, completions):
    """|log p (compacted) - log p (not)| for the same tokens: the two runs evaluate every row's
    forward with other GEMM batch shapes, i.e. the same fp32 sums in other orders. A K-term fp32
    dot product moves by at most K·2^-24 relative to the sum of |terms|; through 2 layers and
    the head (K <= 128, the MLP inner size) the logits move by <= 4·K·2^-24·max|z| (as in
    test_first_step_logits_match_eager_forward), and a log-softmax entry by twice that.
    A row whose cache, slot or seen set belongs to another row is off by the logits' own size."""
    seq = [torch.cat([i[m.bool()], torch.tensor(c, dtype=i.dtype)]) for i, m, c in
           zip(ids, mask, completions)]
    with torch.no_grad():
        zmax = max(model(input_ids=s[None]).logits.abs().max().item() for s in seq)
    return 2 * 4 * 128 * 2.0**-24 * zmax


def assert_same(model, ids, mask, ours, theirs):
    assert ours.token_ids == theirs.token_ids
    bound = logprob_bound(model, ids, mask, theirs.token_ids)
    err = max(abs(a - b) for r, s in zip(ours.logprobs, theirs.logprobs) for a, b in zip(r, s))
    assert err <= bound, (err, bound)


def test_bucket_ladder():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 33)] == [1, 2, 4, 4, 8, 16, 64]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_compaction_equals_without_and_hf(tok, family, fake_graphs):
    """Rows stop at different lengths: the batch shrinks through buckets, each bucket's graph
    is captured once and replayed by the second call; completions equal HF's and the
    uncompacted loop's (tokens exactly, log-probs within `logprob_bound`). Qwen2 has a
    sliding-window layer (the moved cache rows carry each row's window)."""
    model = build(tok, family, lora=True)
    ids, mask = batch(tok, TEXTS)
    gc = config(tok, [mid_eos(model, tok, ids, mask)], new=NEW)
    ref = hf_completions(model, ids, mask, gc)
    assert len({len(r) for r in ref}) >= 3 and max(map(len, ref)) == NEW, ref
    plain, compact = loops()
    base = plain.generate(model, ids, mask, gc)
    assert base.token_ids == ref
    fake_graphs.clear()  # the compacting loop's captures only
    for call in (1, 2):
        out = compact.generate(model, ids, mask, gc)
        assert compact.disabled_reason is None and out is not None
        assert out.token_ids == ref
        assert_same(model, ids, mask, out, base)
        st = compact.stats
        assert st.compactions >= call and st.buckets and max(st.buckets) <= len(TEXTS) // 2
        # one graph for the full batch, one per bucket, all from the first call
        assert st.captures == 1 + len(st.buckets) == len(fake_graphs)
        assert sorted(fake_graphs) == sorted([len(TEXTS)] + st.buckets)
    # row steps saved: each replay at working batch W skips (B - W) · K row steps; at least
    # the rows that had stopped when the smallest bucket first ran, for that replay
    assert st.row_steps_saved >= 2 * (len(TEXTS) - max(st.buckets)) * K
    assert st.steps == plain.stats.steps * 2  # compaction changes which rows run, not how long


def test_repetition_penalty_moves_seen_with_its_row(tok, fake_graphs):
    """The penalty reads each row's seen ids: after a compaction a row must carry its own.
    A first call without the penalty makes the buckets without a seen mask (the state has
    none until a call needs it); the penalized call then makes it, for the buckets too."""
    model = build(tok, "llama", lora=True)
    ids, mask = batch(tok, TEXTS)
    eos = [mid_eos(model, tok, ids, mask)]
    gc = config(tok, eos, new=NEW, repetition_penalty=1.5)
    ref = hf_completions(model, ids, mask, gc)
    plain, compact = loops()
    unpenalized = config(tok, eos, new=NEW)
    assert compact.generate(model, ids, mask, unpenalized).token_ids == \
        hf_completions(model, ids, mask, unpenalized)
    (state,) = compact._states.values()
    assert state.seen is None and state.buckets  # compacted, and no mask made
    base = plain.generate(model, ids, mask, gc)
    out = compact.generate(model, ids, mask, gc)
    assert base.token_ids == ref and out.token_ids == ref
    assert compact.stats.compactions >= 2
    assert state.seen is not None and all(
        v.seen.data_ptr() == state.seen.data_ptr() for v in state.buckets.values())
    assert_same(model, ids, mask, out, base)


@pytest.mark.parametrize("stop", ["never", "first_token"])
def test_rows_that_stop_together_are_not_compacted(tok, fake_graphs, stop):
    """All rows run to max_new_tokens (an EOS never drawn), or all stop at their first token
    (EOS = every row's first greedy token): the batch never shrinks, results as without."""
    model = build(tok, "qwen3")
    ids, mask = batch(tok, TEXTS)
    never = config(tok, [len(tok) + 7], new=NEW)
    eos = [len(tok) + 7]
    if stop == "first_token":
        eos = sorted({r[0] for r in hf_completions(model, ids, mask, never)})
    gc = config(tok, eos, new=NEW)
    ref = hf_completions(model, ids, mask, gc)
    assert all(len(r) == (NEW if stop == "never" else 1) for r in ref), ref
    plain, compact = loops()
    base = plain.generate(model, ids, mask, gc)
    out = compact.generate(model, ids, mask, gc)
    assert out.token_ids == ref == base.token_ids and out.logprobs == base.logprobs
    assert compact.stats.compactions == compact.stats.row_steps_saved == 0
    assert compact.stats.captures == 1


def test_single_survivor(tok, fake_graphs):
    """Every row but one stops early: the batch shrinks down to the bucket of one row."""
    model = build(tok, "llama", lora=True)
    ids, mask = batch(tok, TEXTS)
    gc = config(tok, [mid_eos(model, tok, ids, mask)], new=NEW)
    ref = hf_completions(model, ids, mask, gc)
    short = [i for i, r in enumerate(ref) if len(r) < NEW // 2]
    long = [i for i, r in enumerate(ref) if len(r) == NEW]
    assert len(short) >= 2 and long, ref
    rows = short + long[:1]
    sub_ids, sub_mask = ids[rows], mask[rows]
    keep = sub_mask.any(0)  # drop columns that are padding in every kept row
    sub_ids, sub_mask = sub_ids[:, keep], sub_mask[:, keep]
    sub_ref = hf_completions(model, sub_ids, sub_mask, gc)
    assert sorted(map(len, sub_ref))[-2:] != [NEW, NEW]  # one survivor
    plain, compact = loops()
    base = plain.generate(model, sub_ids, sub_mask, gc)
    out = compact.generate(model, sub_ids, sub_mask, gc)
    assert out.token_ids == sub_ref == base.token_ids
    assert_same(model, sub_ids, sub_mask, out, base)
    assert 1 in compact.stats.buckets


def test_no_bucket_graph_past_max_captures(tok, fake_graphs, monkeypatch, caplog):
    """With the capture budget spent by the full batch's graph, the batch is not compacted (one
    logged line) and the completions are still HF's."""
    monkeypatch.setattr(loop_module, "MAX_CAPTURES", 1)
    model = build(tok, "llama", lora=True)
    ids, mask = batch(tok, TEXTS)
    gc = config(tok, [mid_eos(model, tok, ids, mask)], new=NEW)
    _, compact = loops()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert compact.generate(model, ids, mask, gc).token_ids == \
                hf_completions(model, ids, mask, gc)
    assert compact.disabled_reason is None
    assert compact.stats.captures == 1 and compact.stats.compactions == 0
    lines = [r.getMessage() for r in caplog.records if "finished rows stay" in r.getMessage()]
    assert len(lines) == 1, lines


def test_sampled_logprobs_under_compaction(tok, fake_graphs):
    """Sampling with compaction: the seeded draws map to other rows than without it (module
    docstring), so the check is validity: every token's log-prob equals the processed
    distribution's, recomputed through transformers' processors on the full sequence (as
    test_sampled_logprobs_equal_the_processed_distribution: |ours - fp64| <= 8·|fp32 - fp64|
    + 2e-5), and each row ends at its first EOS or at max_new_tokens."""
    opts = {"temperature": 0.8, "top_k": 30, "repetition_penalty": 1.2}
    model = build(tok, "qwen2", lora=True)
    ids, mask = batch(tok, TEXTS)
    # EOS: the ids most often drawn, so rows stop at spread-out lengths
    torch.manual_seed(0)
    free = hf_completions(model, ids, mask, config(tok, [len(tok) + 7], new=NEW, do_sample=True,
                                                   **opts))
    counts = torch.bincount(torch.tensor([t for r in free for t in r]), minlength=len(tok))
    eos = counts.topk(3).indices.tolist()
    gc = config(tok, eos, new=NEW, do_sample=True, **opts)
    _, compact = loops()
    torch.manual_seed(1)
    out = compact.generate(model, ids, mask, gc)
    assert compact.disabled_reason is None and compact.stats.compactions >= 1
    for row in out.token_ids:
        assert (row[-1] in eos) or len(row) == NEW
        assert not set(row[:-1]) & set(eos)
    ref64 = recompute_logprobs(model, ids, mask, out.token_ids, opts, torch.float64)
    ref32 = recompute_logprobs(model, ids, mask, out.token_ids, opts, torch.float32)
    flat = lambda rows: torch.tensor([x for r in rows for x in r], dtype=torch.float64)
    ours, r64, r32 = flat(out.logprobs), flat(ref64), flat(ref32)
    assert torch.isfinite(r64).all()
    err, ref_err = (ours - r64).abs(), (r32 - r64).abs().max().item()
    i = int(err.argmax())
    assert err.max().item() <= 8 * ref_err + 2e-5, (i, ours[i].item(), r64[i].item(), ref_err)


@pytest.mark.slow  # an interpreted loop run; compaction by default: the torch attention cases
def test_compaction_with_triton_decode_attention(tok, fake_graphs, monkeypatch):
    """decode_attention (the Triton interpreter on CPU) reads each row's valid keys from the
    bucket's leading-row views of the cache; Mistral's sliding window included."""
    attention_only(monkeypatch)
    model = build(tok, "mistral", lora=True)
    ids, mask = batch(tok, TEXTS)
    gc = config(tok, [mid_eos(model, tok, ids, mask)], new=12)
    compact = DecodeLoop(devices=("cpu",), check_every=K, compact_finished=True)
    out = compact.generate(model, ids, mask, gc)
    assert compact.disabled_reason is None and out is not None
    assert out.token_ids == hf_completions(model, ids, mask, gc)
    assert compact.stats.compactions >= 1


# -- GPU: bucket graphs captured for real ------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compaction_greedy_and_replay():
    """bf16 Llama, CUDA graphs for the full batch and each bucket: greedy completions with
    compaction against eager `generate` (divergences only at bf16 near-ties, `_near_tie`), and
    against the uncompacted loop; a second call replays every bucket graph (no capture); one
    host check per k tokens."""
    from test_sampling_loop import _gpu_llama, _gpu_prompts, _greedy_gap, _near_tie
    from transformers import GenerationConfig

    model = _gpu_llama()
    ids, mask = _gpu_prompts(512, batch=16)
    N, k = 64, 8
    never = 512 + 7

    def gc_for(eos):
        return GenerationConfig(max_new_tokens=N, do_sample=False, pad_token_id=0,
                                eos_token_id=[eos])

    gc = gc_for(spread_eos(hf_completions(model, ids, mask, gc_for(never)), never))
    ref = hf_completions(model, ids, mask, gc)
    plain = DecodeLoop(check_every=k)
    compact = DecodeLoop(check_every=k, compact_finished=True)
    base = plain.generate(model, ids, mask, gc)
    out = compact.generate(model, ids, mask, gc)
    assert compact.disabled_reason is None and out is not None
    st = compact.stats
    print(f"\nlengths {sorted(map(len, ref))}; {st}")
    assert st.compactions >= 1 and st.captures == 1 + len(st.buckets)
    captures = st.captures
    layers = model.config.num_hidden_layers
    gaps = _greedy_gap(model, ids, mask, out.token_ids, ref)
    assert all(_near_tie(*g[2:], layers) for g in gaps), gaps
    same = sum(a == b for a, b in zip(out.token_ids, base.token_ids))
    print(f"rows identical to the uncompacted loop: {same} of {len(ref)}")
    assert same >= len(ref) * 3 // 4
    again = compact.generate(model, ids, mask, gc)
    assert compact.stats.captures == captures and again.token_ids == out.token_ids
    assert compact.stats.host_checks <= 2 * (math.ceil((N - 1) / k) + 1)
