"""The decode loop: prefill, then decode steps captured k at a time as one CUDA graph.

Device-side state of one call, in static buffers per (cache, vocabulary):

    cur (B,) the last sampled token     slot (B,) where it is written (= its position)
    done (B,) bool                      step (1,) the output column the next token goes to
    out (B, N + k) int64, logp (B, N + k) fp32: the tokens and their log-probs by step
    seen (B, V + 1) bool: the ids the repetition penalty applies to (column V: padding), made
        by the first call with a repetition penalty (the others neither read nor write it)

One decode step: logits = decode(cur at slot) → process → sample (y, log p_y);
y <- pad where done (a finished row emits padding and its slot stops advancing); write y and
log p_y at column `step`; done |= y ∈ EOS; cur <- y; slot += ¬done_before; step += 1 (with
the plan's `record`, one launch: `kernels.record.record_step`).
No value reaches the host inside a step. On CUDA with capture, k = `check_every` steps are one
graph, replayed until N tokens are written; after each replay the host reads `done.all()` once
(the only sync per k tokens) and stops early when every row has finished. Steps past N (the
last group) write into the k spare columns and the cache's k spare slots, then are trimmed.
Off CUDA (tests) the same steps run eagerly, with the same k-step checks.

A graph is captured once per (cache shape, sampling options, model state): the model state is
the train/eval mode of each module, the addresses of its parameters and its PEFT adapter
switches, so a moved parameter or a disabled adapter gets a new capture instead of a replay of
stale Python choices.
Optimizer steps update parameters in place, so replays read the current weights.
A graph keeps addresses, not Python references: every tensor a captured step reads is owned by
the state or the cache (a per-call tensor would be freed and reused under the graph).

Compaction (`compact_finished=True`; off by default: on a model that stops it pays at batch 64, not
at 8, bench/README.md): at a host check the host reads the working batch's `done` (the same one
sync) and, when the live rows fit a bucket b <= W / 2 of the working batch W (buckets: powers of
two, b = the smallest >= the live count), moves them in place to rows [0, b) of the same state and
cache tensors (live rows first, then finished ones to fill b; cache slots up to the furthest
written one) and goes on with b's graph, captured on first use and replayed by later calls; there
are at most log2(B) buckets, and a capture past MAX_CAPTURES is not made (the batch stays as it is,
one logged line). Invariants: working row j holds original row `orig[j]` (cur, slot, done, seen and
its cache row move together); `out` and `logp` never move: a bucket writes row j's token into row
orig[j], so a finished row's output stays as written. Each row's step is a function of its own row
only, so greedy completions equal the uncompacted loop's up to the rounding of other GEMM batch
shapes: log-probs within fp32 (bf16) rounding, tokens identical except at near-ties that this
rounding decides (as eager's own batch-size variation). Sampling draws one (W, V) noise tensor per
step, so after a compaction the seeded draws land on other rows than without it: each row is still
drawn from its own processed distribution, but the draws differ from the uncompacted loop's.

Kernels (`kernels="auto"`, the default; they run on CUDA): decode steps run each residual add +
RMSNorm through `add_rmsnorm`, RoPE with the cache write through `rope_cache_write` and, for a
decode batch of at most `kernel_plan.FUSED_LINEAR_MAX_ROWS` rows, the q/k/v/o and gate/up/down
projections through the fused 4-bit + LoRA decode linear where it serves the module
(`kernel_plan`, which decides it; the plan is made once per model state and batch and logged in
one line). `kernels="torch"` runs the modules' own forward. The first call of each plan is
checked as below; if the check fails with the kernels, they are turned off for the run (one
logged line) and the check is repeated without them.

Safety: the first call checks the loop's logits for the first two tokens (prefill and one
decode step) against the model's own eager forward on the same prompts, in eval mode; a
mismatch beyond the dtype's noise, or any exception, turns the loop off for the rest of the run
with one logged line, and `generate` returns None.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time

import torch
from transformers.utils import logging

from ..generation import completion_lengths
from ..models import BaseTunerLayer
from . import processors
from .cache import MAX_GROWTHS, KVCache, prompt_room
from .kernel_plan import KERNELS, TORCH, make_plan
from .kernels import pdl
from .kernels.record import record_step, record_step_torch
from .model_step import ModelStep, base_model, model_reason

logger = logging.get_logger(__name__)

# First-call check: mean |ours - eager| <= RTOL · mean |eager| over the two tokens' logits.
# fp32: both forwards sum the same products in different orders (SDPA backends, batch shapes);
# the relative error of a K-term fp32 dot product is below K·2^-24 (~1e-4 for K = 2048), far
# below 1e-3, while a wrong position, mask or cache slot moves logits by their own size.
# bf16 / fp16: through a deep stack rounding moves logits by a few per cent (as FastSampler's
# check allows), still an order below what a broken cache does.
CHECK_RTOL = {torch.float32: 1e-3}
CHECK_RTOL_LOW = 0.1
# the first-call check of the sampling kernels: their log-prob against torch's log_softmax.
# Both sum exp over V in fp32, in different orders: torch's threads each add V/1024 terms in
# sequence, then a tree; the kernels tree-sum chunks of 4096, then their S chunks. The relative
# difference of the sums is at most (V/1024 + log2 V + S + 8) · 2⁻²⁴ < 1e-4 for V <= 2^20, an
# absolute difference of the log-probs; a broken reduction is off by O(1).
SAMPLE_LOGP_ATOL = 1e-3
GRAPHS_PER_STATE = 4  # graphs kept per buffer shape (oldest dropped), model states x options
MAX_CAPTURES = 16  # more means the model state changes at every call: replays would not pay


@dataclasses.dataclass
class LoopStats:
    calls: int = 0  # calls served by the loop
    captures: int = 0  # CUDA graphs captured
    capture_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0  # decode steps run (k per replay)
    host_checks: int = 0  # reads of done.all()
    first_token_s: float | None = None  # first call's start to its first sampled token
    growths: int = 0  # caches grown for a longer prompt
    graph_s: float = 0.0  # inside graph replays, by CUDA events (only with time_graphs)
    compactions: int = 0  # working batches shrunk (compact_finished)
    compacted_rows: int = 0  # rows dropped from the working batch, summed over compactions
    row_steps_saved: int = 0  # row decode steps not computed: (B - working batch) per step
    buckets: list = dataclasses.field(default_factory=list)  # working batch sizes used, sorted


@dataclasses.dataclass
class Completions:
    token_ids: list[list[int]]  # each row up to and including its first EOS
    logprobs: list[list[float]]  # fp32 log p of each token under its processed distribution


@dataclasses.dataclass
class _State:
    cur: torch.Tensor
    slot: torch.Tensor
    done: torch.Tensor
    step: torch.Tensor
    out: torch.Tensor
    logp: torch.Tensor
    seen: torch.Tensor | None  # None until a call with a repetition penalty (`with_seen`)
    # the full batch: (B,) int64, the original row of each row (compaction permutes the rows);
    # a bucket: None
    orig: torch.Tensor | None = None
    # a bucket: (b,) view of the full state's orig, where `out` / `logp` rows are written;
    # the full batch: None (row b writes row b)
    rows: torch.Tensor | None = None
    graphs: dict = dataclasses.field(default_factory=dict)  # (spec, fingerprint) -> CUDAGraph
    # EOS ids -> (E,) int64: a graph reads the tensor it was captured with at every replay, so
    # the tensor lives as long as the state that holds the graph
    eos: dict = dataclasses.field(default_factory=dict)
    buckets: dict = dataclasses.field(default_factory=dict)  # b -> _State of views of rows [0, b)

    def tensors(self):
        return tuple(t for t in (self.cur, self.slot, self.done, self.step, self.out, self.logp,
                                 self.seen) if t is not None)

    def with_seen(self, vocab: int) -> torch.Tensor:
        """`seen`, made (zeros) on first use, and the bucket views' rows of it."""
        if self.seen is None:
            self.seen = torch.zeros(self.cur.shape[0], vocab + 1, dtype=torch.bool,
                                    device=self.cur.device)
            for b, view in self.buckets.items():
                view.seen = self.seen[:b]
        return self.seen

    def leading(self, b: int) -> _State:
        """A state for working rows [0, b): views of cur, slot, done and seen, the shared step,
        out and logp, written through rows = orig[:b]; made once and kept (graphs read it)."""
        view = self.buckets.get(b)
        if view is None:
            view = self.buckets[b] = _State(
                cur=self.cur[:b], slot=self.slot[:b], done=self.done[:b], step=self.step,
                out=self.out, logp=self.logp, seen=None if self.seen is None else self.seen[:b],
                rows=self.orig[:b])
        return view


def bucket(live: int) -> int:
    """The working batch for `live` rows: the smallest power of two >= live."""
    return 1 << max(live - 1, 0).bit_length()


def _eos_ids(config) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _fingerprint(model) -> int:
    """What a captured graph bakes in, hashed: every module's train / eval mode, every
    parameter's address, and the adapter choices PEFT makes in Python at every forward (which
    adapters are active, disabled or merged, their scalings). One pass over the modules: it runs
    at every call, over thousands of modules at 8B."""
    modes, switches = [], []
    for m in model.modules():
        modes.append(m.training)
        if isinstance(m, BaseTunerLayer) and hasattr(m, "scaling"):
            switches.append((bool(m.disable_adapters), tuple(m.active_adapters),
                             tuple(getattr(m, "merged_adapters", ())),
                             tuple(sorted(m.scaling.items()))))
    return hash((tuple(modes), tuple(p.data_ptr() for p in model.parameters()),
                 tuple(switches)))


def _resolve_config(model, generation_config):
    """The generation config HF's `generate` would run with (the model's own generation config
    and transformers' defaults fill what the caller left unset)."""
    base = base_model(model)
    prepare = getattr(base, "_prepare_generation_config", None)
    if prepare is None:
        return copy.deepcopy(generation_config)
    out = prepare(copy.deepcopy(generation_config))
    return out[0] if isinstance(out, tuple) else out


CAPTURE_DEVICES = ("cuda",)  # where `capture` takes effect (tests add "cpu" with a fake graph)


@contextlib.contextmanager
def _on_stream(stream):
    """Run the block on `stream` (a CUDA graph's warm-up), or as it is where None (off CUDA)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _graph_of(run, pool, stream):
    """`run()` captured as a CUDA graph on `stream`: `.replay()` runs its kernels on the static
    buffers.

    One memory pool for all graphs: a graph's outputs live in the static state, never in the
    pool, so what one graph leaves there is dead at its end and another may reuse it.
    One stream for all warm-ups and captures: torch keeps a cuBLAS workspace per (handle,
    stream) for the life of the process, so a cuBLAS call in a captured step costs one, not one
    per warm-up stream and another for torch's capture stream.
    thread_local: another thread's CUDA calls (a data loader's pinning) do not break capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        run()
    return graph


class DecodeLoop:
    """Samples on-policy completions with our own decode loop (module docstring)."""

    def __init__(self, *, devices=("cuda",), check_every: int = 16, capture: bool = True,
                 max_prompt_length: int | None = None, kernels: str = "auto",
                 compact_finished: bool = False):
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.kernels = kernels  # "auto" | "torch" (kernel_plan); "torch" after a failed check
        self.devices = tuple(devices)
        self.check_every = int(check_every)
        self.capture = bool(capture)
        self.compact_finished = bool(compact_finished)  # module docstring: Compaction
        self.max_prompt_length = max_prompt_length  # first prompt room of a cache, when known
        self.time_graphs = False  # CUDA events around replays (stats.graph_s); costs a sync
        self.disabled_reason: str | None = None
        self.stats = LoopStats()
        self._caches: dict[tuple, KVCache] = {}  # (batch, new tokens) -> cache
        # (batch, new tokens, capacity, vocab) -> state: one cache per state, since its graphs
        # read that cache (two caches of one batch and capacity differ in N)
        self._states: dict[tuple, _State] = {}
        self._checked: set[tuple] = set()  # (id(model), plan.line) whose first call passed
        self._logged: set[str] = set()
        self._plans: dict[tuple, object] = {}  # (id(model), fingerprint, batch) -> KernelPlan
        self._pool = None  # the graphs' memory pool and their stream, made at the first capture
        self._stream = None

    # -- policy -----------------------------------------------------------------------------

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.warning(f"grpo_lce decode loop: {message}")

    def cache_bytes(self) -> int:
        """Bytes of the KV caches this loop holds now (kept between calls, one per batch size and
        completion length)."""
        return sum(cache.nbytes() for cache in self._caches.values())

    def disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.warning(f"grpo_lce decode loop off ({reason}); sampling with the fallback "
                           "path for the rest of the run.")
        self._caches.clear()
        self._states.clear()

    def unsupported_reason(self, model, generation_config) -> str | None:
        """Why this loop cannot sample from `model` with `generation_config`, or None."""
        param = next(model.parameters(), None)
        if param is None or param.device.type not in self.devices:
            where = None if param is None else param.device.type
            return f"the model is on {where!r}; the loop runs on {' / '.join(self.devices)}"
        reason = model_reason(model)
        if reason is not None:
            return reason
        base = base_model(model)
        quantizer = getattr(base, "hf_quantizer", None)
        if quantizer is not None:
            qc = getattr(quantizer, "quantization_config", None)
            method = getattr(qc, "quant_method", "")
            method = getattr(method, "value", method)
            if method != "bitsandbytes" or not getattr(qc, "load_in_4bit", False):
                return f"quantization {method!r} (only bitsandbytes 4-bit is covered)"
        try:
            config = _resolve_config(model, generation_config)
        except Exception as exc:  # noqa: BLE001 - a config HF itself rejects
            return f"generation_config does not resolve: {type(exc).__name__}: {exc}"
        _, reason = processors.spec_from_config(config, base.config.vocab_size)
        return reason

    def _plan_for(self, model, fingerprint, device, batch):
        key = (id(model), fingerprint, batch)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make_plan(base_model(model), self.kernels, device.type,
                                                batch)
            self._log_once(plan.line)
        return plan

    # -- buffers ----------------------------------------------------------------------------

    def _cache_for(self, model, batch, prompt_len, new_tokens) -> KVCache | None:
        key = (batch, new_tokens)
        cache = self._caches.get(key)
        if cache is not None and prompt_len <= cache.room:
            return cache
        base = base_model(model)
        if cache is None:
            room = prompt_room(max(prompt_len, self.max_prompt_length or 0))
            growths = 0
        elif cache.growths >= MAX_GROWTHS:
            self._log_once(f"a {prompt_len}-token prompt does not fit the cache ({cache.room} "
                           f"prompt tokens, grown {MAX_GROWTHS} times); such batches fall back")
            return None
        else:
            room, growths = prompt_room(prompt_len, cache.room), cache.growths + 1
            self.stats.growths += 1
            logger.warning(f"grpo_lce decode loop: cache for batch {batch} grown to {room} prompt "
                           f"tokens for a {prompt_len}-token prompt ({growths} of {MAX_GROWTHS} "
                           "growths; a new graph is captured)")
        self._caches.pop(key, None)
        self._states = {k: s for k, s in self._states.items() if k[0] != batch}
        emb = base.get_input_embeddings().weight
        dtype = emb.dtype if emb.dtype.is_floating_point else torch.bfloat16
        cache = KVCache.allocate(base.config, batch=batch, room=room, new_tokens=new_tokens,
                                 slack=self.check_every, growths=growths, dtype=dtype,
                                 device=emb.device)
        self._caches[key] = cache
        return cache

    def _state_for(self, cache, batch, vocab, device) -> _State:
        key = (batch, cache.new_tokens, cache.capacity, vocab)
        state = self._states.get(key)
        if state is None:
            width = cache.new_tokens + self.check_every
            state = self._states[key] = _State(
                cur=torch.zeros(batch, dtype=torch.long, device=device),
                slot=torch.zeros(batch, dtype=torch.long, device=device),
                done=torch.zeros(batch, dtype=torch.bool, device=device),
                step=torch.zeros(1, dtype=torch.long, device=device),
                out=torch.zeros(batch, width, dtype=torch.long, device=device),
                logp=torch.zeros(batch, width, dtype=torch.float32, device=device),
                seen=None, orig=torch.arange(batch, device=device))
        return state

    # -- the steps --------------------------------------------------------------------------

    def _sample_record(self, st, z, spec, eos, pad, plan):
        """Process logits z (B, V) and sample token y (B,) with log p_y (`processors`; the plan's
        `sample`: its sampling kernel), write them at column `step`, then advance the row state
        (`kernels.record`; the plan's `record`: one launch). With a repetition penalty, `seen`
        is read for the processing and y is marked in it."""
        penalty = spec.repetition_penalty != 1.0
        y, lp = processors.sample(processors.process(z, spec, st.seen[:, :-1] if penalty else None),
                                  spec, fused=plan.sample)
        record = record_step if plan.record else record_step_torch
        record(y, lp, st.done, eos, pad, st.out, st.logp, st.step, st.slot, st.cur, st.rows)
        if penalty:  # cur: y, with pad where the row had finished
            st.seen.scatter_(1, st.cur[:, None], True)

    def _decode_steps(self, step_fn, cache, st, spec, eos, pad, n):
        with pdl.decode_step():  # the decode kernels may launch with PDL (kernels.pdl)
            for _ in range(n):
                # slot: where `cur` is written; its slot advanced when it was recorded, so it
                # is one past the last written slot of a live row: cur sits at slot - 1
                z = step_fn.decode(cache, st.cur, st.slot - 1)
                self._sample_record(st, z, spec, eos, pad, step_fn.plan)

    def _capture(self, step_fn, cache, st, spec, eos, pad):
        t0 = time.perf_counter()
        dev = st.cur.device
        saved = [t.clone() for t in st.tensors()]
        rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()
        if self._pool is None and dev.type == "cuda":
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)
        with _on_stream(self._stream):  # warm-up: lazy inits, workspaces, allocator
            self._decode_steps(step_fn, cache, st, spec, eos, pad, 1)
        # the warm-up step never happened: state and random stream as before it (its cache
        # writes land in slots the first real step writes again before any query reads them)
        for t, s in zip(st.tensors(), saved):
            t.copy_(s)
        if dev.type == "cuda":
            torch.cuda.set_rng_state(rng, dev)
        else:
            torch.set_rng_state(rng)
        graph = _graph_of(functools.partial(self._decode_steps, step_fn, cache, st, spec, eos,
                                            pad, self.check_every), self._pool, self._stream)
        if st.cur.is_cuda:
            torch.cuda.synchronize()
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        return graph

    def _graph_for(self, step_fn, cache, st, spec, eos, pad, gkey):
        """st's graph for gkey, captured on first use; None where that would pass MAX_CAPTURES."""
        graph = st.graphs.get(gkey)
        if graph is None:
            if self.stats.captures >= MAX_CAPTURES:
                return None
            if st.graphs:
                self._log_once("model state or sampling options changed: new graphs "
                               "are captured for them")
            if len(st.graphs) >= GRAPHS_PER_STATE:
                st.graphs.pop(next(iter(st.graphs)))
            graph = st.graphs[gkey] = self._capture(step_fn, cache, st, spec, eos, pad)
        return graph

    def _compact(self, step_fn, st, cache, done, b, written_slots, spec, eos, pad, gkey):
        """Moves the working batch's live rows (done: its (W,) host copy) and finished ones to
        fill b to rows [0, b) of the full state `st` and `cache`; returns (state, cache, graph)
        of the b-row working batch (graph None off the capture path), or None, the batch
        unchanged, where b's graph would be a capture past MAX_CAPTURES."""
        B, W = st.cur.shape[0], done.shape[0]
        work, work_cache = st.leading(b), cache.leading(b)
        if gkey is not None and gkey not in work.graphs and self.stats.captures >= MAX_CAPTURES:
            self._log_once(f"{MAX_CAPTURES} graphs captured, none for smaller working batches: "
                           "finished rows stay in the batch")
            return None
        ladder = [1 << i for i in reversed(range((B // 2).bit_length()))]  # powers of 2 <= B/2
        self._log_once(f"compacting finished rows: batch {B} shrinks through working batches "
                       f"of {ladder} rows, one graph each, captured on first use")
        # live rows first, each group in working order; idx (b,) < W
        idx = torch.cat([(~done).nonzero()[:, 0], done.nonzero()[:, 0]])[:b].to(st.cur.device)
        # `written` tokens recorded: a row's cache holds its prompt and written - 1 decoded
        # tokens (the last is `cur`, not yet written), slots < P_b + written - 1 <= written_slots
        cols = min(written_slots, cache.capacity)
        for kv in (cache.k, cache.v):
            for i in range(kv.shape[0]):  # layer by layer: a (b, H_kv, cols, D) temporary
                kv[i, :b, :, :cols] = kv[i, idx, :, :cols]
        for t in (st.cur, st.slot, st.done, st.seen, st.orig):  # the right side is a copy
            if t is not None:
                t[:b] = t[idx]
        self.stats.compactions += 1
        self.stats.compacted_rows += W - b
        self.stats.buckets = sorted(set(self.stats.buckets) | {b})
        graph = None
        if gkey is not None:
            graph = self._graph_for(step_fn, work_cache, work, spec, eos, pad, gkey)
        return work, work_cache, graph

    # -- the call ---------------------------------------------------------------------------

    @torch.no_grad()
    def _check(self, model, step_fn, cache, ids_left, lengths, input_ids, attention_mask):
        """None, or why the loop's first two logits rows differ from the eager forward's."""
        modes = [(m, m.training) for m in model.modules()]  # restored module by module
        model.eval()
        try:
            z0 = step_fn.prefill(cache, ids_left, lengths)
            y0 = z0.argmax(-1)
            with pdl.decode_step():  # the kernels the captured steps run (one compile)
                z1 = step_fn.decode(cache, y0, lengths)
            ids = torch.cat([input_ids, y0[:, None]], 1)
            mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], 1)
            ref = model(input_ids=ids, attention_mask=mask, use_cache=False,
                        logits_to_keep=2).logits[:, -2:]
        finally:
            for m, training in modes:
                m.training = training
        ours = torch.stack([z0, z1], 1)
        ref = ref.float()
        if not torch.isfinite(ours).all():
            return "non-finite logits in the first-call check"
        err = (ours - ref).abs().mean().item()
        scale = ref.abs().mean().item()
        rtol = CHECK_RTOL.get(cache.k.dtype, CHECK_RTOL_LOW)
        if not err <= rtol * scale:
            return (f"first-call logits differ from the eager forward: mean |diff| {err:.3g} "
                    f"against mean |logit| {scale:.3g} (tolerance {rtol:g} of it)")
        if step_fn.plan.sample:  # greedy through the sampling kernels against torch's ops
            greedy = processors.SamplingSpec(False, 1.0, 0, 1.0, None, 1.0)
            y, lp = processors.sample(z0, greedy, fused=True)
            y_ref, lp_ref = processors.sample(z0, greedy)
            lp_err = (lp - lp_ref).abs().max().item()
            if not torch.equal(y, y_ref) or not lp_err <= SAMPLE_LOGP_ATOL:
                return (f"first-call sampling kernels differ from torch's: tokens "
                        f"{'equal' if torch.equal(y, y_ref) else 'differ'}, max |Δ log p| "
                        f"{lp_err:.3g} (tolerance {SAMPLE_LOGP_ATOL:g})")
        return None

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask, generation_config):
        """Completions of the left-padded prompts, or None (see `disabled_reason`, or the one
        logged line of an unsupported model, config or prompt)."""
        if self.disabled_reason is not None:
            return None
        reason = self.unsupported_reason(model, generation_config)
        if reason is not None:
            self._log_once(f"not used ({reason})")
            return None
        try:
            return self._generate(model, input_ids, attention_mask, generation_config)
        except Exception as exc:  # noqa: BLE001 - any failure falls back, with its reason
            self.disable(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                         if str(exc) else type(exc).__name__)
            return None

    def _generate(self, model, input_ids, attention_mask, generation_config):
        t_call = time.perf_counter()
        first_call = self.stats.calls == 0
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must be one (B, P) shape")
        config = _resolve_config(model, generation_config)
        base = base_model(model)
        spec, _ = processors.spec_from_config(config, base.config.vocab_size)
        B, P = input_ids.shape
        dev = input_ids.device
        lengths = attention_mask.long().sum(1)  # (B,) prompt lengths P_b
        pos = torch.arange(P, device=dev)
        left_padded = attention_mask.bool() == (pos[None] >= (P - lengths)[:, None])
        if not bool(left_padded.all()) or int(lengths.min()) < 1:
            self._log_once("a batch whose prompts are not left-padded or are empty falls back")
            return None
        N = config.max_new_tokens
        if N is None:
            N = config.max_length - P
        if N < 1:
            raise ValueError(f"max_new_tokens={N}: nothing to generate")
        cache = self._cache_for(model, B, P, N)
        if cache is None:
            return None
        # row b's prompt moved to [0, P_b): ids_left[b, i] = input_ids[b, i + P - P_b]
        shift = (P - lengths)[:, None]
        ids_left = input_ids.gather(1, (pos[None] + shift).clamp(max=P - 1))
        fingerprint = _fingerprint(model)
        step_fn = ModelStep(model, self._plan_for(model, fingerprint, dev, B))
        checked_key = (id(model), step_fn.plan.line)  # each kernel path is checked once
        if checked_key not in self._checked:
            try:
                mismatch = self._check(model, step_fn, cache, ids_left, lengths, input_ids,
                                       attention_mask)
            except Exception as exc:  # with the kernels: retried without them
                if not step_fn.plan.active:
                    raise
                mismatch = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if mismatch is not None and step_fn.plan.active:
                logger.warning(f"grpo_lce decode loop: kernels off for the run ({mismatch})")
                self.kernels = "torch"
                self._plans.clear()
                step_fn = ModelStep(model, TORCH)
                checked_key = (id(model), TORCH.line)
                mismatch = self._check(model, step_fn, cache, ids_left, lengths, input_ids,
                                       attention_mask)
            if mismatch is not None:
                self.disable(mismatch)
                return None
            self._checked.add(checked_key)

        t0 = time.perf_counter()
        eos_list = _eos_ids(config)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos_list or [0])[0]
        z = step_fn.prefill(cache, ids_left, lengths)  # (B, V) fp32
        V = z.shape[1]
        st = self._state_for(cache, B, V, dev)
        eos = st.eos.get(tuple(eos_list))
        if eos is None:
            eos = st.eos[tuple(eos_list)] = torch.tensor(eos_list or [-1], dtype=torch.long,
                                                         device=dev)
        st.done.zero_()
        st.step.zero_()
        st.out.fill_(pad)
        st.logp.zero_()
        if spec.repetition_penalty != 1.0:  # the prompt's ids, padding to the spare column V
            seen = st.with_seen(V)
            seen.zero_()
            seen.scatter_(1, torch.where(pos[None] < lengths[:, None], ids_left, V), True)
        st.slot.copy_(lengths)
        self._sample_record(st, z, spec, eos, pad, step_fn.plan)
        if first_call:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            self.stats.first_token_s = time.perf_counter() - t_call
        self.stats.prefill_s += time.perf_counter() - t0

        graph = gkey = None
        if self.capture and dev.type in CAPTURE_DEVICES:
            gkey = (spec, tuple(eos_list), pad, fingerprint, step_fn.plan)
            graph = self._graph_for(step_fn, cache, st, spec, eos, pad, gkey)
            if graph is None:
                self.disable(f"{self.stats.captures} CUDA graphs captured: the model state "
                             "or the sampling options change from call to call")
                return None
        t0 = time.perf_counter()
        st.orig.copy_(torch.arange(B, device=dev))
        work, work_cache, W = st, cache, B  # the working batch: rows [0, W) of st and cache
        written = 1
        while written < N:
            self.stats.host_checks += 1
            if self.compact_finished:
                done = work.done.cpu()  # the one device-to-host read per k tokens
                live = W - int(done.sum())
                if live == 0:
                    break
                if 2 * bucket(live) <= W:
                    moved = self._compact(step_fn, st, cache, done, bucket(live), P + written - 1,
                                          spec, eos, pad, gkey)
                    if moved is not None:
                        work, work_cache, graph = moved
                        W = work.cur.shape[0]
            elif bool(st.done.all()):  # the one device-to-host read per k tokens
                break
            if graph is not None:
                if self.time_graphs and dev.type == "cuda":
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    self.stats.graph_s += start.elapsed_time(end) / 1e3
                else:
                    graph.replay()
            else:
                self._decode_steps(step_fn, work_cache, work, spec, eos, pad, self.check_every)
            written += self.check_every
            self.stats.steps += self.check_every
            self.stats.row_steps_saved += (B - W) * self.check_every
        out = st.out[:, :N].cpu()
        logp = st.logp[:, :N].cpu()
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.calls += 1
        ends = completion_lengths(out, eos_list)
        return Completions([r[:n].tolist() for r, n in zip(out, ends)],
                           [r[:n].tolist() for r, n in zip(logp, ends)])
