"""One forward: compose the weights the device reads, enter the fault plan, apply the model.

Every caller that runs the model (the sampler, the trainer's policy and critic passes,
evaluation, the severity curve, SRDD's scans) goes through `forward`, so that what attaches to
the weights attaches in one place:

  * LoRA adapters (`Weights.lora`, the `lora` collection read by the family's `Linear`:
    `y = x W + (alpha / rank) (x A) B`, the factored form, see `aqn_jax/lora.py`);
  * trained RMSNorm weights over a frozen base (`Weights.norms`, QeRL's `--ln`);
  * a packed low-precision base (`aqn_jax/quant_base.py`: NVFP4/MXFP4 codes and scales,
    dequantised here, inside the jitted program, on every call);
  * `weight_transform`, a params -> params function applied to the weights exactly as the
    forward reads them, then the plan's weight faults of this phase (`bitfaults.TreeBits` with
    target 'weight': bit flips or stuck bits of the weights as read, the stored ones untouched;
    their flips are reported in `fault_stats` under `weights`).

With a `Readout`, the model stops at its final hidden states and `forward` returns the
log-probs (and entropy) of given tokens at given positions instead of the logits: the head runs
on those positions only, a chunk at a time, under the same interceptors (`aqn_jax/logprobs.py`).

`params` is either a plain param tree (full fine-tuning, the reference, the embedded default:
nothing changes for it) or a `Weights`. The fault plan's interceptor is entered inside this
function, so it must be called inside the jitted program (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from aqn_jax import quant_base
from aqn_jax.faults.intercept import FaultPlan, fault_part
from aqn_jax.faults.transforms import STATE_COLLECTION as STATE
from aqn_jax.faults.transforms import STATS_COLLECTION as STATS
from aqn_jax.logprobs import check_head_faults, chunked_logprobs
from aqn_jax.models.registry import init_cache, lm_head

LORA_COLLECTION = "lora"
_NO_FAULTS = FaultPlan()


@flax.struct.dataclass
class Weights:
    """A policy's weights as the device reads them.

    base: the full param tree (its decoder linear kernels may be `quant_base.Packed`); frozen.
    lora: the adapters, `{<module path>: {"a": [in, r], "b": [r, out]}}` nested like `base`,
      or None (the base alone: the reference policy of a LoRA run).
    norms: trained RMSNorm weights, nested like `base`, that replace the base's, or None.
    scale: alpha / rank, static (a compile-time constant of every program).
    """

    base: Any
    lora: Any = None
    norms: Any = None
    scale: float = flax.struct.field(pytree_node=False, default=1.0)

    def without_adapters(self) -> Weights:
        """The base alone (QeRL's reference policy: no second copy of the weights)."""
        return Weights(self.base, None, None, self.scale)


def override(tree, leaves):
    """`tree` with the leaves of the (sparse, same nesting) `leaves` put in."""
    if leaves is None:
        return tree
    if not isinstance(leaves, Mapping):
        return leaves
    out = dict(tree)
    for k, v in leaves.items():
        out[k] = override(tree[k], v)
    return out


def _scaled(lora, scale: float):
    """The adapters as the `lora` collection: each linear's {a, b} plus its scale."""

    def walk(node):
        if "a" in node and "b" in node and not isinstance(node["a"], Mapping):
            return {"a": node["a"], "b": node["b"], "scale": jnp.float32(scale)}
        return {k: walk(v) for k, v in node.items()}

    return walk(lora)


def variables(params, weight_transform: Callable | None = None) -> dict[str, Any]:
    """The Flax variables of `params` (a param tree or `Weights`): packed kernels dequantised,
    trained norms put in, adapters in their collection, then `weight_transform` on the params."""
    lora = None
    if isinstance(params, Weights):
        lora = None if params.lora is None else _scaled(params.lora, params.scale)
        params = override(params.base, params.norms)
    params = quant_base.dequantize(params)
    if weight_transform is not None:
        params = weight_transform(params)
    out = {"params": params}
    if lora is not None:
        out[LORA_COLLECTION] = lora
    return out


@flax.struct.dataclass
class Readout:
    """What `forward` returns instead of the logits: `(logp, entropy)`, each `[B, R]`, of
    `tokens` `[B, R]` as predicted at positions start .. start + R - 1 of the input, under
    softmax(logits / temperature); the head runs on those positions only, a chunk
    (`config.model.logprob_chunk` positions) at a time (`aqn_jax/logprobs.py`)."""

    tokens: jax.Array
    start: int = flax.struct.field(pytree_node=False, default=0)
    temperature: float = flax.struct.field(pytree_node=False, default=1.0)

    @classmethod
    def next_token(cls, ids_BT: jax.Array) -> Readout:
        """Each next token of `ids` from the position before it (positions 0 .. T - 2)."""
        return cls(ids_BT[:, 1:], 0, 1.0)


@dataclasses.dataclass(frozen=True)
class SharedPrompt:
    """Rows whose first `T - resp_len` tokens (the left-padded prompt) are the same in each
    block of `group` consecutive rows: `forward` runs each block's prompt once, as `[B / group,
    P]`, keeping every layer's K/V in a KV cache, then the responses as `[B, resp_len]`
    attending to their block's prompt K/V (repeated per row) and causally to their own, at
    positions that continue from the prompt's real tokens. The outputs are those at positions
    P - 1 .. T - 2 (the ones that predict the response tokens), `[B, resp_len, ...]`; the
    gradient through the repeat sums over the block (Prefix Grouper, arXiv 2506.05433).

    The prompt and the responses are two model calls: a random fault on the prompt's
    positions is drawn once per block (under its own `fault_part`), and a statistic over a
    call would see one or the other (`FaultPlan.split_refusals` says which faults differ)."""

    group: int
    resp_len: int


_PROMPT_PART, _RESPONSE_PART = (
    1 << 30,
    (1 << 30) + 1,
)  # the two calls' `fault_part`s (chunks: 0, 1, ..)


def forward(
    model: nn.Module,
    params,
    ids: jax.Array,
    mask: jax.Array | None = None,
    *,
    plan: FaultPlan | None = None,
    phase: str = "eval",
    key: jax.Array | None = None,
    values: Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    mutable: Sequence[str] = (),
    interceptors: Sequence[Callable] = (),
    weight_transform: Callable | None = None,
    readout: Readout | None = None,
    share: SharedPrompt | None = None,
    **kwargs,
):
    """`model.apply` of `params` on `ids` (attention `mask`) on the device of `plan` in `phase`.

    key/values: the fault plan's base key and traced per-step values (`FaultPlan.apply`).
    state: extra variable collections passed in (e.g. the causal-scope `fault_state`).
    mutable: collections returned; with any, the result is `(out, {collection: tree})`.
    interceptors: entered outside the fault plan's (SRDD's probes: the layer calls they make
      go through the plan). kwargs: the model's own (cache, last_only, positions).
    readout: `(logp, entropy)` of its tokens in place of the logits (`Readout`).
    share: the prompt once per block of rows (`SharedPrompt`); the outputs (or the readout's
      positions, which must start at the prompt's last position) are the response's.
    """
    plan = plan or _NO_FAULTS
    if readout is not None:
        check_head_faults(plan)
    flips: list[jax.Array] = []
    faults = plan.tree_faults(phase, "weight")
    if faults:  # weight faults: on the weights as this forward reads them, after the rest
        weight_transform = _with_weight_faults(weight_transform, faults, key, values, flips)
    vs = variables(params, weight_transform)
    if state:
        vs.update(state)
    with contextlib.ExitStack() as stack:
        for icpt in interceptors:
            stack.enter_context(nn.intercept_methods(icpt))
        stack.enter_context(plan.apply(phase, key=key, values=values or {}))
        if share is not None:
            return _shared(model, vs, ids, mask, share, readout, mutable)
        if readout is not None:
            return _read(model, vs, ids, mask, readout, mutable, **kwargs)
        if mutable:
            out, got = model.apply(vs, ids, attention_mask=mask, mutable=list(mutable), **kwargs)
            if flips and STATS in mutable:  # the weight faults' telemetry, as a site's
                n = sum(flips).astype(jnp.float32)
                stats = {**got.get(STATS, {}), "weights": {f"{faults[0][1].name}.flips": (n,)}}
                got = {**got, STATS: stats}
            return out, got
        return model.apply(vs, ids, attention_mask=mask, **kwargs)


def _read(model: nn.Module, vs, ids, mask, readout: Readout, mutable: Sequence[str], **kwargs):
    """`forward`'s readout, inside its contexts: the model to its final hidden states, then the
    head over the read positions a chunk at a time, under the same interceptors (each chunk
    a `fault_part`); the head's telemetry joins the model's under its site."""
    mutable = list(mutable)
    out = model.apply(vs, ids, attention_mask=mask, hidden=True, mutable=mutable or False, **kwargs)
    hidden_BTD, got = out if mutable else (out, {})
    R = readout.tokens.shape[1]
    x_BRD = hidden_BTD[:, readout.start : readout.start + R]
    return _read_head(model, vs, x_BRD, got, readout, mutable)


def _read_head(model: nn.Module, vs, x_BRD, got, readout: Readout, mutable: Sequence[str]):
    """The readout's head over the final hidden states `x_BRD` of its positions, a chunk at a
    time (each a `fault_part`); its telemetry joins `got`'s."""
    head = lm_head(model.config)
    sow = [STATS] if STATS in mutable else False

    def apply_head(x_NcD, part):
        with fault_part(part):
            out = head.apply(vs, x_NcD, mutable=sow)
        return out if sow else (out, {})

    chunk = model.config.logprob_chunk
    logp, ent, stats = chunked_logprobs(
        apply_head, x_BRD, readout.tokens, readout.temperature, chunk
    )
    if not mutable:
        return logp, ent
    if stats.get(STATS):
        got = {**got, STATS: {**got.get(STATS, {}), **stats[STATS]}}
    return (logp, ent), got


def _shared(model: nn.Module, vs, ids, mask, share: SharedPrompt, readout, mutable):
    """`forward`'s shared prompt (`SharedPrompt`), inside its contexts."""
    g, R = share.group, share.resp_len
    B, T = ids.shape
    P = T - R
    if B % g or not 0 < R < T:
        raise ValueError(f"SharedPrompt(group={g}, resp_len={R}) for rows [B, T] = [{B}, {T}]")
    if readout is not None and (readout.start != P - 1 or readout.tokens.shape[1] != R):
        raise ValueError(
            f"a shared prompt reads the response: Readout(start={readout.start}, tokens"
            f" {readout.tokens.shape[1]}) must be (start={P - 1}, {R} tokens)"
        )
    kw = dict(hidden=readout is not None, mutable=list(dict.fromkeys([*mutable, STATE])))
    with fault_part(_PROMPT_PART):
        (out_p, cache), got_p = model.apply(
            vs,
            ids[::g, :P],
            attention_mask=mask[::g, :P],
            cache=init_cache(model.config, B // g, T),
            **kw,
        )

    def rep(x):
        return jnp.repeat(x, g, axis=0)

    cache = jax.tree_util.tree_map(lambda x: rep(x) if x.ndim else x, cache)
    state = got_p.pop(STATE, None)
    vs_r = {**vs, STATE: jax.tree_util.tree_map(rep, state)} if state else vs
    with fault_part(_RESPONSE_PART):
        (out_r, _), got_r = model.apply(
            vs_r, ids[:, P:], attention_mask=mask[:, P:], cache=cache, **kw
        )
    got_r.pop(STATE, None)
    out = jnp.concatenate([rep(out_p[:, -1:]), out_r[:, :-1]], axis=1)  # positions P-1 .. T-2
    # Telemetry: each stat the mean over both calls' tokens (a fraction of the whole pass).
    w = (B // g) * P / ((B // g) * P + B * R)
    got = {k: v for k, v in got_r.items() if k != STATS}
    if STATS in got_r:
        got[STATS] = jax.tree_util.tree_map(
            lambda a, b: w * a + (1 - w) * b, got_p[STATS], got_r[STATS]
        )
    if readout is not None:
        return _read_head(model, vs, out, got, readout, mutable)
    return (out, got) if mutable else out


def _with_weight_faults(weight_transform, faults, key, values, flips: list):
    """`weight_transform` followed by the plan's weight faults (`bitfaults.TreeBits`), keyed
    by the forward's fault key (seed, step, phase) and each injection's index; the bits they
    change are appended to `flips`."""
    if key is None:
        raise ValueError(
            f"weight faults ({', '.join(inj.name for _, inj in faults)}) need the forward's"
            " fault key: forward(..., key=step_key(seed, step, phase))"
        )

    def transform(params):
        if weight_transform is not None:
            params = weight_transform(params)
        for index, inj in faults:
            params, n = inj.transform.apply(
                params, inj.sites, jax.random.fold_in(key, index), values or {}, tag="w/"
            )
            flips.append(n)
        return params

    return transform


def trace_manifest(
    plan: FaultPlan, model: nn.Module, params, phase: str, seq_len: int = 2
) -> dict[str, list[str]]:
    """The hits of `plan` in `phase`, {injection name: [site:point]}, from one `forward` of
    `params` traced abstractly (`jax.eval_shape`: nothing runs): the plan's interceptor around
    it, on the weights the device reads (`params`: a param tree, or the `Weights` of a LoRA run:
    the packed base and its adapters); a tree-level injection's hits are the param paths it
    selects in those weights as the forward reads them (`variables`). An injection that hits
    nothing raises."""
    ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    values = {name: jnp.float32(1.0) for name in plan.value_names()}
    trees = [inj for _, inj in plan.active(phase) if inj.transform.level == "tree"]
    traced: dict[str, list[str]] = {}

    def run(params, ids):
        with plan.apply(phase, key=jax.random.key(0), values=values) as hits:
            out = forward(model, params, ids)  # no plan of its own: the one around it
        traced.update(hits)
        read = variables(params)["params"]
        for inj in trees:
            traced[inj.name] = inj.transform.paths(read, inj.sites)
        return out

    jax.eval_shape(run, params, ids)
    for inj in trees:
        if not traced[inj.name]:
            raise ValueError(
                f"phase {phase!r}: fault injection matched no parameter: {inj.describe()}"
            )
    return traced


def token_nll(model: nn.Module, params, ids_BT, mask_BT, loss_mask_BT, **kwargs):
    """(sum, count) of the next-token cross-entropy of `ids` where `loss_mask` is 1 (the
    prediction of token t+1 from position t, in float32, through `forward`'s readout: the head a
    chunk of positions at a time): the held-out loss of evaluation and of the severity curve, and
    the SFT loss. kwargs: `forward`'s; with `mutable`, ((sum, count), the collections)."""
    out = forward(model, params, ids_BT, mask_BT, readout=Readout.next_token(ids_BT), **kwargs)
    (logp_BT, _), got = out if kwargs.get("mutable") else (out, None)
    w = loss_mask_BT[:, 1:].astype(jnp.float32)
    nll = (-jnp.sum(logp_BT * w), jnp.sum(w))
    return nll if got is None else (nll, got)
