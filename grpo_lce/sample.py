"""linear_sample: the next token of every row, drawn from softmax(h Wᵀ / τ), without the logits.

h (B, H), W (V, H), b (V,), τ ≥ 0;   z = (h Wᵀ + b) / τ   (fp32, tile by tile, never (B, V))
    kept_b = {v : z_bv ≥ t_b},  t_b = max(t_k, t_p, t_min)       (the logits processors)
    tok_b ~ softmax(z_b) restricted to kept_b                    (Gumbel-max: argmax z + g)
    logp_b = z_b,tok − log Σ_{v ∈ kept_b} exp(z_bv)         (fp32; the distribution drawn from)
    τ = 0: tok_b = the first argmax of z at τ = 1, logp_b at τ = 1

The processors, in transformers' order (temperature, top-k, top-p, min-p), each a threshold on z:
    top-k   t_k = the k-th largest z_b                  (ties with it kept, as TopKLogitsWarper)
    top-p   t_p = the z of the last token of the shortest prefix (z in decreasing order) of the
            top-k-kept distribution whose mass reaches top_p
    min-p   t_min = max_v z_bv + log(min_p)            (p_v ≥ min_p · p_max; order-free)

Paths (the backend of grpo_lce._dispatch.decide):
    triton  temperature, greedy and min-p: kernels/sample_rows streams W once per pass (min-p
            adds a first pass for the row max); no host sync, capturable in a CUDA graph.
    torch   everything, over vocabulary chunks of `chunk_size` columns (cuBLAS / CPU GEMMs into
            one (B, chunk) fp32 buffer): CPU, and top-k / top-p on every device. Top-k and top-p
            need the order statistics of the row, which a tile cannot know; this path keeps the
            running top candidates (B, K) of a first pass, K = top_k or min(V, 1024) for top-p
            alone, and finds the threshold among them; a row whose 1024 candidates hold less
            than top_p of the mass is redone alone over its full (V,) logits, after a host read
            of whether any row needs it (top-p without top-k is therefore not capturable).
Extra memory: the (B, V / BLOCK_V) partials (Triton); one (B, chunk) fp32 chunk and (B, K)
candidates (torch).
"""

from __future__ import annotations

import math

import torch

from grpo_lce._checks import check_head
from grpo_lce._dispatch import decide
from grpo_lce._mm import mm_f32
from grpo_lce.kernels import sample_rows

DEFAULT_VOCAB_CHUNK = 8192  # columns of one logits chunk on the torch path
TOP_P_CANDIDATES = 1024


def _check_options(temperature, top_k, top_p, min_p, chunk_size, V):
    if isinstance(temperature, torch.Tensor):
        raise TypeError("temperature must be a Python float, not a tensor")
    tau = float(temperature)
    if not (tau >= 0.0) or math.isinf(tau):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got "
                         f"{temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 (None: no top-k), got {top_k}")
    if top_p is not None and not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (None: no top-p), got {top_p}")
    if min_p is not None and not (0.0 <= float(min_p) <= 1.0):
        raise ValueError(f"min_p must be in [0, 1] (None: no min-p), got {min_p}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    # options that truncate nothing are dropped: top_k >= V, top_p = 1, min_p = 0
    top_k = None if top_k is None or top_k >= V else top_k
    top_p = None if top_p is None or float(top_p) >= 1.0 else float(top_p)
    min_p = None if min_p is None or float(min_p) <= 0.0 else float(min_p)
    return tau, top_k, top_p, min_p


def _draw_seed(generator, device) -> torch.Tensor:
    """A Philox seed as an int64 (1,) tensor on the device, drawn from the generator there
    (no host sync: the kernel loads it)."""
    return torch.randint(0, 2**62, (1,), generator=generator, device=device, dtype=torch.int64)


def _sample_triton(h, w, bias, inv_tau, greedy, min_p, generator):
    threshold = None
    if min_p is not None:  # a first pass for the row max
        stats = sample_rows.sample_tiles(h, w, bias, inv_tau, stats_only=True)
        threshold = sample_rows.combine(stats, log_min_p=math.log(min_p))
    seed = None if greedy else _draw_seed(generator, h.device)
    part = sample_rows.sample_tiles(h, w, bias, inv_tau, threshold=threshold, seed=seed)
    return sample_rows.combine(part)


def _chunks(h, w, bias, inv_tau, C):
    """(v0, z (B, c) fp32) over the vocabulary in chunks of C columns."""
    V = w.shape[0]
    for v0 in range(0, V, C):
        v1 = min(V, v0 + C)
        z = mm_f32(h, w[v0:v1].t())  # (B, c) fp32, fp32 accumulation
        if bias is not None:
            z += bias[v0:v1].float()
        yield v0, z.mul_(inv_tau)


def _top_p_threshold(desc, lse, top_p):
    """t_p per row from z in decreasing order (R, K) and the lse of the distribution they come
    from; also whether the K values hold at least top_p of its mass."""
    cum = torch.exp(desc - lse[:, None]).cumsum(1)
    j = (cum < top_p).sum(1, keepdim=True).clamp_max(desc.shape[1] - 1)
    return desc.gather(1, j).squeeze(1), cum[:, -1] >= top_p


def _thresholds(h, w, bias, inv_tau, top_k, top_p, min_p, C):
    """t (B,) fp32 from a first pass over the chunks: row max, lse and the top candidates."""
    B, V = h.shape[0], w.shape[0]
    K = top_k if top_k is not None else (min(V, TOP_P_CANDIDATES) if top_p is not None else 0)
    m = torch.full((B,), float("-inf"), device=h.device)
    l = torch.zeros(B, device=h.device)
    cand = torch.empty(B, 0, device=h.device)  # (B, ≤ K) the largest z so far, decreasing
    for _, z in _chunks(h, w, bias, inv_tau, C):
        m_new = torch.maximum(m, z.amax(1))
        l = l * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
        m = m_new
        if K:
            both = torch.cat([cand, z], 1)
            cand = both.topk(min(K, both.shape[1]), dim=1).values
    t = torch.full((B,), float("-inf"), device=h.device)
    if top_k is not None:
        t = cand[:, -1]
    if top_p is not None:
        # top-p acts on the top-k-kept distribution, renormalized
        lse = torch.logsumexp(cand, 1) if top_k is not None else m + torch.log(l)
        t_p, enough = _top_p_threshold(cand, lse, top_p)
        if top_k is None and K < V and not bool(enough.all()):  # host read (module docstring)
            for r in (~enough).nonzero().flatten().tolist():
                row = torch.cat([z for _, z in _chunks(h[r:r + 1], w, bias, inv_tau, C)], 1)
                t_p[r] = _top_p_threshold(row.sort(1, descending=True).values, lse[r:r + 1],
                                          top_p)[0][0]
        t = torch.maximum(t, t_p)
    if min_p is not None:
        t = torch.maximum(t, m + math.log(min_p))
    return t


def _sample_torch(h, w, bias, inv_tau, greedy, thresholds, generator, C):
    """Gumbel-max over the chunks with the kept set z ≥ t, the noise in fp64 (E = −log1p(−U))."""
    B = h.shape[0]
    dev = h.device
    t = thresholds
    m = torch.full((B,), float("-inf"), device=dev)
    l = torch.zeros(B, device=dev)
    s = torch.full((B,), float("-inf"), device=dev, dtype=torch.float64)
    tok = torch.zeros(B, device=dev, dtype=torch.int64)
    zt = torch.zeros(B, device=dev)
    for v0, z in _chunks(h, w, bias, inv_tau, C):
        keep = z >= t[:, None] if t is not None else torch.ones_like(z, dtype=torch.bool)
        zk = torch.where(keep, z, float("-inf"))
        m_new = torch.maximum(m, zk.amax(1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        l = l * torch.exp(m - m_safe) + torch.exp(zk - m_safe[:, None]).sum(1)
        m = m_new
        if greedy:
            score = zk.double()
        else:
            u = torch.rand(z.shape, generator=generator, device=dev, dtype=torch.float64)
            e = torch.clamp_min(-torch.log1p(-u), 2.0**-60)  # Exp(1); u = 0 has mass 2⁻⁵³
            score = torch.where(keep, z.double() - torch.log(e), float("-inf"))
        j = score.argmax(1, keepdim=True)  # the first maximum of the chunk
        s_c = score.gather(1, j).squeeze(1)
        better = s_c > s  # strict: an earlier chunk (lower index) wins a tie
        s = torch.where(better, s_c, s)
        tok = torch.where(better, j.squeeze(1) + v0, tok)
        zt = torch.where(better, z.gather(1, j).squeeze(1), zt)
    return tok, zt - (m + torch.log(l))


def linear_sample(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    bias: torch.Tensor | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    chunk_size: int | None = None,
):
    """Draw one token per row from softmax((hidden @ weight.T + bias) / temperature), with its
    log-probability, without allocating the (B, V) logits.

    Equals ``torch.multinomial(softmax(z), 1)`` in distribution, z = (h Wᵀ + b).float() / τ
    (fp32 accumulation, logits never rounded), after the optional truncations (module
    docstring); the log-prob is that of the drawn token under the distribution it was drawn
    from: truncated to the kept set and renormalized, after temperature, in fp32.

    Args:
        hidden: (..., H) float32 / bfloat16 / float16; every leading index is a row.
        weight: (V, H), same dtype and device as hidden; any V.
        temperature: >= 0. 0 is greedy: the token is the argmax of the logits (the lowest index
            on a tie, as torch.argmax), its log-prob that under softmax at temperature 1 (after
            the truncations, at temperature 1, which always keep the argmax).
        generator: a torch.Generator on hidden's device, or None for torch's default one. Each
            call draws one Philox seed from it (Triton path) or its uniforms (torch path), so a
            seeded generator reproduces the tokens. The Triton path draws the seed as a device
            tensor, no host sync: the call can be captured in a CUDA graph, and each replay
            draws fresh tokens; with a generator other than the default one, register it with
            the graph (``graph.register_generator_state(generator)``) before capture.
        bias: optional (V,).
        top_k: keep the top_k largest logits (and ties with the k-th); None: all.
        top_p: in (0, 1]: keep the smallest set of largest logits with mass >= top_p.
        min_p: in [0, 1]: keep the tokens with p >= min_p · max p.
        chunk_size: vocabulary columns per logits chunk on the torch path (default 8192); the
            torch path's tokens for a given seed depend on it, the Triton path's do not.

    Returns:
        (tokens, logprobs): int64 and fp32, hidden's leading shape.

    Covered processors: temperature, greedy and min-p in the Triton kernel (min-p: two passes
    over W); top-k and top-p on the chunked torch path on every device (module docstring).
    No autograd: sampling is not differentiable, and the call runs under no_grad.
    """
    check_head(hidden, weight, bias)
    V, H = weight.shape
    tau, top_k, top_p, min_p = _check_options(temperature, top_k, top_p, min_p, chunk_size, V)
    if V == 0:
        raise ValueError(f"weight has an empty vocabulary (weight shape {tuple(weight.shape)})")
    if generator is not None and generator.device.type != hidden.device.type:
        raise ValueError(f"generator is on {generator.device} but hidden is on {hidden.device}")
    lead = hidden.shape[:-1]
    greedy = tau == 0.0
    inv_tau = 1.0 if greedy else 1.0 / tau
    with torch.no_grad():
        h = hidden.reshape(-1, H)
        if h.shape[0] == 0:
            return (torch.empty(lead, dtype=torch.int64, device=h.device),
                    torch.empty(lead, dtype=torch.float32, device=h.device))
        h = h if h.stride(-1) == 1 else h.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        path = decide(h, w, bias)
        if path.backend == "triton" and top_k is None and top_p is None:
            path.note("sample", "triton")
            tok, logp = _sample_triton(h, w, bias, inv_tau, greedy, min_p, generator)
        else:
            path.note("sample", "torch")
            C = chunk_size or DEFAULT_VOCAB_CHUNK
            t = None
            if top_k is not None or top_p is not None or min_p is not None:
                t = _thresholds(h, w, bias, inv_tau, top_k, top_p, min_p, C)
            tok, logp = _sample_torch(h, w, bias, inv_tau, greedy, t, generator, C)
    return tok.reshape(lead), logp.reshape(lead)
