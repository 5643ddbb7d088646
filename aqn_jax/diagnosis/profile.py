"""The residual stream's per-layer profile: how big its values are, and where the largest sits.

A real pretrained LM has massive activations: SmolLM2-135M-Instruct's residual stream reaches
max|h| ~ 24,900 in one channel at the first token from layer 11 on, against a median of 2-15
(docs/ARCHITECTURE.md). A fault stated relative to the tensor max (the seed's deadzone) is then
a far stronger fault than on a model without them, so every model's summary prints this profile.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax.forward import forward
from aqn_jax.models import registry


def layer_outputs(model: nn.Module, params, ids, mask=None) -> list[jax.Array]:
    """Every decoder layer's output (the residual stream after it), [B, T, D] each, in order,
    of `forward` (no faults) on `params` (a param tree or `forward.Weights`)."""

    def only_layers(mdl: nn.Module, method: str) -> bool:
        if method != "__call__":
            return False
        site = registry.site_of(mdl.path, mdl)
        return site is not None and site[0] == "layer"

    _, state = forward(
        model, params, ids, mask, mutable=["intermediates"], capture_intermediates=only_layers
    )
    inter = state["intermediates"]
    n = model.config.num_hidden_layers
    return [inter[registry.layer_name(model.config, i)]["__call__"][0][0] for i in range(n)]


@jax.jit
def _stats(h_BTD, mask_BT):
    a = jnp.abs(h_BTD.astype(jnp.float32))
    valid = jnp.broadcast_to(mask_BT[..., None] > 0, a.shape)
    flat = jnp.where(valid, a, jnp.nan).reshape(-1)
    where = jnp.argmax(jnp.where(valid, a, -1.0).reshape(-1))
    return (
        jnp.nanmax(flat),
        jnp.nanmedian(flat),
        jnp.nanpercentile(flat, 99.0),
        jnp.nanmean(flat),
        where,
    )


def residual_profile(model: nn.Module, params, ids, mask=None) -> list[dict]:
    """Per layer: max, median, 99th percentile and mean of |h| over the real (unpadded) tokens,
    max/median, and where the max sits (row, token position within the row, channel)."""
    ids = jnp.asarray(ids)
    mask = jnp.ones_like(ids) if mask is None else jnp.asarray(mask)
    outs = layer_outputs(model, params, ids, mask)
    rows = []
    B, T = ids.shape
    m = np.asarray(mask)
    for i, h in enumerate(outs):
        mx, med, p99, mean, where = (np.asarray(v) for v in _stats(h, mask))
        b, t, c = np.unravel_index(int(where), h.shape)
        rows.append(
            dict(
                layer=i,
                max=float(mx),
                median=float(med),
                p99=float(p99),
                mean=float(mean),
                max_over_median=float(mx / med) if med > 0 else float("inf"),
                max_row=int(b),
                max_token=int(m[b, : t + 1].sum() - 1),  # position among the row's real tokens
                max_channel=int(c),
            )
        )
    return rows


def format_profile(rows: list[dict]) -> str:
    lines = [
        "residual stream per layer (|h| over the prompt's tokens):",
        f"{'layer':>5s} {'max':>10s} {'p99':>9s} {'median':>9s} {'max/median':>10s}"
        f"  max at (token, channel)",
    ]
    for r in rows:
        lines.append(
            f"{r['layer']:5d} {r['max']:10.4g} {r['p99']:9.4g} {r['median']:9.4g}"
            f" {r['max_over_median']:10.4g}  ({r['max_token']}, {r['max_channel']})"
        )
    return "\n".join(lines)
