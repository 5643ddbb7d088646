"""Per-token log-probs and entropy from the final hidden states, a chunk of positions at a time.

Every log-prob the trainer reads (the update's policy log-probs and entropy, the prepare pass's
old and reference log-probs, the held-out NLL of evaluation and the severity curve, the SFT
loss) is `log softmax(logits / temperature)` at one token per position. Applying the head to
every position first holds `[rows, positions, vocab]` float32 logits, and the log-softmax and
the backward's gradient as much again: at Qwen2.5's 151,936-token vocabulary that, not the
decoder, sets the micro-batch. Here the head runs on `chunk` positions (every row) at
a time inside a `lax.map`, each chunk under `jax.checkpoint`, so the forward keeps only the
chunk's two outputs and the backward recomputes the chunk's logits: `[rows, chunk, vocab]`
exists, never more (Liger's fused linear cross-entropy and verl's fused kernels do the same).
The caller passes only the positions the loss reads (the response, not the prompt).

The head is the model family's own module (`registry.lm_head`), applied by `forward` inside the
fault plan's interceptor, so a fault at the `lm_head` site still acts on its logits, one chunk
at a time: each chunk folds its index into the site keys (`intercept.fault_part`: independent
noise per chunk, and the same noise when the backward recomputes it) and its telemetry is
combined over the chunks (counts summed, the rest averaged weighted by the chunk's positions).
A statistic over the whole call (scope 'call' or 'causal': a deadzone's amax, NVFP4's global
scale) cannot be taken a chunk at a time; such a plan is refused (`check_head_faults`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.faults.transforms import COUNT_STATS

# The transforms' scopes whose result at a token depends on that token alone (`ops.SCOPES`;
# None: no tensor-wide statistic).
_PER_TOKEN_SCOPES = (None, "token")


def logprobs_from_logits(logits_NTV: jax.Array, tokens_NT: jax.Array, temperature: float):
    """(log-prob of `tokens`, entropy) per position of softmax(logits / temperature), in
    float32: the chunk's computation, and on whole logits the unfused reference of the tests."""
    z_NTV = logits_NTV.astype(jnp.float32) / temperature
    lse_NT = jax.nn.logsumexp(z_NTV, axis=-1)
    p_NTV = jnp.exp(z_NTV - lse_NT[..., None])
    entropy_NT = lse_NT - jnp.sum(p_NTV * z_NTV, axis=-1)
    chosen_NT = jnp.take_along_axis(z_NTV, tokens_NT[..., None], axis=-1)[..., 0]
    return chosen_NT - lse_NT, entropy_NT


def chunked_logprobs(
    head: Callable, x_NRD: jax.Array, tokens_NR: jax.Array, temperature: float, chunk: int
):
    """(logp_NR, entropy_NR, head telemetry) of `tokens` from the hidden states `x` that predict
    them. `head(x_NcD, part) -> (float32 logits_NcV, telemetry)` is applied to `chunk` positions
    of every row at a time (`part`: the chunk's index); R // chunk full chunks in a `lax.map`,
    the remainder as one more (no padding: a fault never sees positions that do not exist)."""
    N, R = tokens_NR.shape
    c = max(1, min(int(chunk), R))
    full, tail = divmod(R, c)

    @jax.checkpoint  # the backward recomputes the chunk's logits instead of keeping them
    def part(x_NcD, tokens_Nc, index):
        logits_NcV, stats = head(x_NcD, index)
        logp_Nc, ent_Nc = logprobs_from_logits(logits_NcV, tokens_Nc, temperature)
        return logp_Nc, ent_Nc, stats

    logps, ents, stats, weights = [], [], [], []
    if full:
        split = lambda a: jnp.moveaxis(a[:, : full * c].reshape(N, full, c, *a.shape[2:]), 1, 0)
        merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(N, full * c)
        lp, ent, st = jax.lax.map(
            lambda xs: part(*xs), (split(x_NRD), split(tokens_NR), jnp.arange(full))
        )
        logps.append(merge(lp))
        ents.append(merge(ent))
        stats.append(st)
        weights += [c] * full
    if tail:
        lp, ent, st = part(x_NRD[:, full * c :], tokens_NR[:, full * c :], jnp.int32(full))
        logps.append(lp)
        ents.append(ent)
        stats.append(jax.tree_util.tree_map(lambda v: v[None], st))
        weights.append(tail)
    return jnp.concatenate(logps, 1), jnp.concatenate(ents, 1), _combine(stats, weights)


def _combine(stats: list, weights: list[int]):
    """One telemetry tree from the chunks' (each leaf stacked over its chunks): counts summed,
    the rest averaged weighted by the positions of each chunk."""
    w = jnp.asarray(weights, jnp.float32)

    def one(path, *leaves):
        v = jnp.concatenate([jnp.asarray(x, jnp.float32) for x in leaves], 0)
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        stat = str(names[-1] if names else "").rpartition(".")[2]
        if stat in COUNT_STATS:
            return jnp.sum(v, axis=0)
        return jnp.tensordot(w, v, axes=1) / jnp.sum(w)

    return jax.tree_util.tree_map_with_path(one, *stats)


def check_head_faults(plan: FaultPlan) -> None:
    """Refuse (one line) an injection at the `lm_head` site whose statistic spans the whole call:
    the readout applies the head a chunk of positions at a time."""
    for inj in plan.injections:
        if "lm_head" not in inj.sites.kinds or inj.transform.level == "tree":
            continue
        scope = getattr(inj.transform, "scope", None)
        if inj.transform.level != "value" or scope not in _PER_TOKEN_SCOPES:
            raise ValueError(
                f"injection {inj.name!r} at lm_head ({inj.transform.describe()}): the log-prob"
                " readout applies the head to config.model.logprob_chunk positions at a time, so"
                f" a {inj.transform.level}-level fault with scope={scope!r} (a statistic over the"
                " whole call) cannot act there; use scope='token'"
            )
