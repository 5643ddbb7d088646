"""Tolerances for comparing two float programs that compute the same function (fused
differently, remat or not, cached or not, batched or looped, noise at zero or no noise).

The bound is a priori, from the dtype and the reductions, never the largest difference one CPU
showed (issue 42: tolerances calibrated on AMD EPYC failed on an Intel Xeon with AMX, whose
XLA:CPU kernels block and vectorise the same sums differently).

A sum or dot product of n terms in floating point with unit roundoff u = eps/2 is within
gamma_n * sum|terms| of the exact value, gamma_n = n u / (1 - n u) ~= n u (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., eq. 3.4 / 3.5), whatever the order of the additions.
Two programs that each round their own way are each within that of the exact value, so within
2 n u = n eps of each other. Along a forward pass the reductions follow one another: to first
order their errors add (each block's gain is O(1): RMSNorm rescales, residuals add), so the path's
bound is eps * (the sum of the reduction lengths on the path) * (the scale of the terms).
"""

from __future__ import annotations

import numpy as np


def eps(dtype=np.float32) -> float:
    """The machine epsilon of `dtype` (2 u): 2**-23 for float32, 2**-7 for bfloat16."""
    import ml_dtypes  # numpy's finfo knows no bfloat16; ml_dtypes' knows it and the rest

    return float(ml_dtypes.finfo(dtype).eps)


def forward_path(cfg, keys: int, *, logits: bool = True, log_softmax: bool = False) -> int:
    """The sum of the reduction lengths one output of a Qwen2 forward passes through (`cfg` a
    Qwen2Config; `keys`: the attended key length). Per decoder layer: the input RMSNorm (D),
    the q/k/v projections (D), the scores (head dim), the softmax's sum and the weighted values
    (keys each), the output projection (heads x head dim), the post-attention RMSNorm (D), the
    gate/up projections (D) and the down projection (F). Then the final norm and the LM head
    (D each, `logits`), and the log-softmax's sum over the vocabulary (`log_softmax`)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.resolved_head_dim
    per_layer = d + d + h + 2 * keys + cfg.num_attention_heads * h + d + d + f
    n = cfg.num_hidden_layers * per_layer
    if logits:
        n += 2 * d
    if log_softmax:
        n += cfg.vocab_size
    return n


def bound(n: int, scale: float, dtype=np.float32) -> float:
    """|a - b| <= n * eps(dtype) * scale for two programs over reductions of total length `n`
    whose terms are of magnitude `scale` (module docstring)."""
    return n * eps(dtype) * float(scale)


def logit_bound(cfg, params) -> float:
    """An upper bound on every |logit| of a Qwen2 model, from its params alone (no forward): the
    final RMSNorm's output is x / rms(x) (norm sqrt(D)) times the gain g, so its norm is at most
    sqrt(D) max|g|; a logit is its dot product with a row of the head (Cauchy-Schwarz)."""
    gain = float(np.abs(np.asarray(params["norm"]["weight"])).max())
    if cfg.tie_word_embeddings:
        head_VD = np.asarray(params["embed_tokens"]["embedding"], np.float64)
    else:
        head_VD = np.asarray(params["lm_head"]["kernel"], np.float64).T
    return float(np.sqrt(cfg.hidden_size) * gain * np.sqrt((head_VD**2).sum(-1)).max())
