"""grpo_lce: exact fp32 log-probs, entropy and cross-entropy from hidden states and the LM head.

Nothing here materializes the ``(tokens, vocab)`` logits: rows are processed in chunks whose
size comes from a memory budget, the logits of one chunk live in one reused fp32 buffer, and
the backward pass of a frozen head is elementwise (the "gradient basis" design, docs/DESIGN.md).

    >>> logp = linear_logprobs(hidden, lm_head.weight, targets)          # (B, T) fp32
    >>> loss = linear_cross_entropy(hidden, lm_head.weight, labels)      # scalar fp32
    >>> out = chunked_linear(my_fn, hidden, lm_head.weight, row_args...)  # any f(X @ W.T)
    >>> d = linear_divergence(h, lm_head.weight, h_teacher, teacher_head.weight, beta=0.5)
    >>> tokens, logp = linear_sample(h_last, lm_head.weight, temperature=0.7, generator=gen)

Importing this package changes no global state; it depends on torch, and on triton where it is
installed (without it every call takes the torch path). Which path a call takes is decided in
grpo_lce/_dispatch.py.
"""

from grpo_lce.chunked import chunked_linear
from grpo_lce.cross_entropy import linear_cross_entropy
from grpo_lce.divergence import linear_divergence
from grpo_lce.logprobs import linear_logprobs
from grpo_lce.sample import linear_sample
from grpo_lce._chunks import DEFAULT_CHUNK_BUDGET_BYTES, default_chunk_size
from grpo_lce._checks import FLOAT_DTYPES

__version__ = "0.1.0"

__all__ = [
    "linear_logprobs",
    "linear_cross_entropy",
    "chunked_linear",
    "linear_divergence",
    "linear_sample",
    "default_chunk_size",
    "DEFAULT_CHUNK_BUDGET_BYTES",
    "FLOAT_DTYPES",
    "__version__",
]
