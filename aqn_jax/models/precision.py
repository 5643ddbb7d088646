"""Model numerics: the dtype names, and float32 products computed in float32 on every backend.

XLA's DEFAULT precision lets a GPU round float32 operands to TF32 (10 mantissa bits) and a TPU
to one bf16 pass: far outside the 1e-4 parity bound against transformers, and the sampler's and
the trainer's programs would round differently. CPU computes f32 products in f32 at either
setting (the same bits). bf16 and f16 operands need nothing: their products are exact in the
float32 accumulator.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# The dtype names a model config accepts (param_dtype, dtype).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dot_precision(dtype: Any) -> jax.lax.Precision | None:
    """`precision=` for a product whose operands are `dtype`: HIGHEST for float32, else None."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
