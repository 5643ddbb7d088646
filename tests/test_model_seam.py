"""The model seam (`models/registry.py`): a family that is not Qwen2 gets fault sites, AQN's
weight noise, the sampler and the planner's activation model from one registry entry, with no
library module changed.

The toy family below is a decoder without attention whose module paths differ from Qwen2's
(`block{i}`, `final_norm`, `head`): a library module that still assumed Qwen2's classes or its
`layers_{i}` paths would miss its sites.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax import planner
from aqn_jax.diagnosis.profile import layer_outputs
from aqn_jax.diagnosis.scans import scan_layers
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key
from aqn_jax.faults.sites import SiteSelector, classify
from aqn_jax.faults.transforms import Deadzone, Noise, NormWeightNoise, Scale
from aqn_jax.forward import Readout, forward, trace_manifest
from aqn_jax.logprobs import logprobs_from_logits
from aqn_jax.models import registry
from aqn_jax.rl.sampler import Sampler, SamplingParams

from tolerance import bound


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    model_type: str = "toy"
    vocab_size: int = 32
    hidden_size: int = 16
    intermediate_size: int = 24
    num_hidden_layers: int = 3
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    tie_word_embeddings: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    logprob_chunk: int = 2


def toy_norm(x, weight, eps):
    return weight * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class ToyNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones_init(), (x.shape[-1],))
        return toy_norm(x, weight, self.eps)


class ToyLinear(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(stddev=0.5)
        return x @ self.param("kernel", init, (x.shape[-1], self.features))


class ToyMLP(nn.Module):
    config: ToyConfig

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(ToyLinear(self.config.intermediate_size, name="up_proj")(x))
        return ToyLinear(self.config.hidden_size, name="down_proj")(h)


class ToyBlock(nn.Module):
    """A decoder layer: `(x, *rest) -> (x, kv)`, here without attention (kv None)."""

    config: ToyConfig

    @nn.compact
    def __call__(self, x):
        return x + ToyMLP(self.config, name="mlp")(ToyNorm(name="input_layernorm")(x)), None


class ToyLM(nn.Module):
    """Each position reads only its own token: the 'cache' is the count of tokens seen."""

    config: ToyConfig
    head: str = "lm"

    @nn.compact
    def __call__(
        self, ids, attention_mask=None, positions=None, cache=None, last_only=False, hidden=False
    ):
        c = self.config
        x = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")(ids)
        for i in range(c.num_hidden_layers):
            x, _ = ToyBlock(c, name=f"block{i}")(x)
        x = ToyNorm(name="final_norm")(x)
        if last_only:
            x = x[:, -1:]
        if hidden:
            return x
        logits = ToyLinear(c.vocab_size, name="head")(x).astype(jnp.float32)
        if cache is None:
            return logits
        return logits, {"end": cache["end"] + ids.shape[1]}


class ToyHead(nn.Module):
    """The head alone at the LM's param path (`head`): the log-prob readout's."""

    config: ToyConfig

    @nn.compact
    def __call__(self, x):
        return ToyLinear(self.config.vocab_size, name="head")(x).astype(jnp.float32)


_TOP = {"embed_tokens": "embed_tokens", "final_norm": "norm", "head": "lm_head"}
_INNER = {
    ("mlp",): "mlp",
    ("mlp", "up_proj"): "up_proj",
    ("mlp", "down_proj"): "down_proj",
    ("input_layernorm",): "input_layernorm",
}


def toy_site_of(path):
    if len(path) == 1 and path[0] in _TOP:
        return _TOP[path[0]], None
    if path and path[0].startswith("block") and path[0][5:].isdigit():
        kind = "layer" if len(path) == 1 else _INNER.get(tuple(path[1:]))
        return None if kind is None else (kind, int(path[0][5:]))
    return None


TOY = registry.Family(
    model_types=("toy",),
    causal_lm=ToyLM,
    lm_head=ToyHead,
    init_cache=lambda config, rows, length: {"end": jnp.zeros((), jnp.int32)},
    layer_name="block{}".format,
    site_of=toy_site_of,
    site_types={
        "layer": ToyBlock,
        "mlp": ToyMLP,
        "up_proj": ToyLinear,
        "down_proj": ToyLinear,
        "input_layernorm": ToyNorm,
        "norm": ToyNorm,
        "embed_tokens": nn.Embed,
        "lm_head": ToyLinear,
    },
    norm_with_weight=lambda module, x, weight: toy_norm(x, weight, module.eps),
    saved_layer_bytes=lambda c, tensor, keys: 4 * (3 * c.hidden_size + 2 * c.intermediate_size),
    forward_layer_bytes=lambda c, tensor, keys, copies: 4 * 2 * c.intermediate_size,
    checkpoint_keys=lambda config: {},
    config_from_hf=None,
    config_to_hf=None,
    linear_kinds=("up_proj", "down_proj"),
    norm_kinds=("input_layernorm", "norm"),
    model_kinds=("embed_tokens", "norm", "lm_head"),
    explicit_only=("embed_tokens", "lm_head"),
    presets={},
)
CONFIG = ToyConfig()
IDS = np.array([[3, 7, 1, 9], [4, 4, 2, 30]], np.int32)


@pytest.fixture
def toy():
    """The toy family registered (one entry), its model and params; unregistered after."""
    registry.FAMILIES.register("toy", TOY)
    try:
        model = registry.causal_lm(CONFIG)
        params = model.init(jax.random.key(0), IDS)["params"]
        yield model, params
    finally:
        registry.FAMILIES.unregister("toy")


def plan_of(*injections):
    return FaultPlan(list(injections))


def test_fault_sites_of_a_registered_family(toy):
    model, params = toy
    plan = plan_of(
        Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5), phases=("train",)),
        Injection("n", SiteSelector(("linear",)), Noise("absolute_gaussian", Scale(0.0))),
    )
    hits = trace_manifest(plan, model, params, "train")
    assert hits["dz"] == ["layers_1/layer:output"]
    # The linear kinds this family has, every layer; its lm_head only when named.
    expected = [f"layers_{i}/{k}:output" for i in range(3) for k in ("up_proj", "down_proj")]
    assert sorted(hits["n"]) == sorted(expected)
    # The deadzone acts where the manifest says: block 1's output, not block 0's.
    with plan.apply("train", key=step_key(0, 0, "train")):
        _, state = model.apply(
            {"params": params}, IDS, capture_intermediates=True, mutable=["intermediates"]
        )
    clean, clean_state = model.apply(
        {"params": params}, IDS, capture_intermediates=True, mutable=["intermediates"]
    )
    out = lambda st, i: np.asarray(st["intermediates"][f"block{i}"]["__call__"][0][0])
    np.testing.assert_array_equal(out(state, 0), out(clean_state, 0))
    faulty, clean1 = out(state, 1), out(clean_state, 1)
    keep = np.abs(clean1) >= 0.5 * np.abs(clean1).max()
    np.testing.assert_array_equal(faulty, np.where(keep, clean1, 0.0))
    assert 0 < keep.mean() < 1


def test_an_unregistered_family_has_no_sites(toy):
    """The negative control: without its registry entry the same modules are no fault sites,
    and a plan aimed at them raises at trace time instead of running clean."""
    model, params = toy
    registry.FAMILIES.unregister("toy")
    assert classify(("block1",), ToyBlock(CONFIG, parent=None)) is None
    plan = plan_of(Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5)))
    with pytest.raises(ValueError, match="matched no module: dz"):
        trace_manifest(plan, model, params, "train")
    with pytest.raises(ValueError, match="model_type='toy'; allowed: .*qwen2"):
        registry.causal_lm(CONFIG)


def test_aqn_weight_noise_uses_the_familys_norm(toy):
    model, params = toy
    clean = model.apply({"params": params}, IDS)

    def noisy(sigma):
        inj = Injection("aqn", SiteSelector(("rmsnorm",)), NormWeightNoise(Scale(sigma)))
        plan = plan_of(inj)
        with plan.apply("rollout", key=step_key(0, 0, "rollout")) as hits:
            logits = model.apply({"params": params}, IDS)
        return logits, hits["aqn"]

    zero, sites = noisy(0.0)
    # Every layer's norm and the final norm; sigma 0 redoes the family's norm exactly.
    assert sorted(sites) == sorted([f"layers_{i}/input_layernorm:output" for i in range(3)]) + [
        "norm:output"
    ]
    np.testing.assert_array_equal(np.asarray(zero), np.asarray(clean))
    perturbed, _ = noisy(0.1)
    assert np.abs(np.asarray(perturbed) - np.asarray(clean)).max() > 1e-3


def test_sampler_and_planner_read_the_family(toy):
    model, params = toy
    sp = SamplingParams(max_new_tokens=3, eos_id=31, pad_id=0, temperature=0.0, vocab_size=32)
    out = Sampler(model, sp, buckets=(4,))(params, IDS, np.ones_like(IDS), jax.random.key(0))
    # Greedy decoding by hand: each position reads only its own token.
    token = IDS[:, -1]
    for t in range(3):
        token = np.asarray(model.apply({"params": params}, token[:, None]))[:, 0].argmax(-1)
        live = out.response_mask[:, t] > 0
        np.testing.assert_array_equal(out.tokens[live, t], token[live])
    assert out.response_mask[:, 0].all()
    # A fault in the sampler's program hits the family's site; its telemetry sits under the
    # layer's own name (the manifest names sites by layer index: `layers_2/layer`).
    plan = plan_of(Injection("dz", SiteSelector(("layer",), (2,)), Deadzone(0.5)))
    faulty = Sampler(model, sp, plan, buckets=(4,), phase="train")
    stats = faulty(params, IDS, np.ones_like(IDS), jax.random.key(0)).fault_stats
    assert set(stats) == {"block2"} and 0 < float(stats["block2"]["dz.flushed"][0]) < 1
    # The planner's activation model is the family's.
    assert planner.saved_layer_bytes(CONFIG, 1, 8) == 4 * (3 * 16 + 2 * 24)
    assert planner.forward_layer_bytes(CONFIG, 1, 8, 2) == 4 * 2 * 24
    # The log-prob readout applies the family's head alone (`lm_head`), a chunk at a time, and
    # a fault at its lm_head site acts there (each token's logits below 0.99 of its largest
    # flushed: a chunk's own tokens decide, so the chunked readout equals the whole call's).
    tokens = jnp.asarray(IDS[:, 1:])
    flush = plan_of(Injection("z", SiteSelector(("lm_head",)), Deadzone(0.99, scope="token")))
    kw = dict(plan=flush, phase="eval", key=step_key(0, 0, "eval"))
    for plan_kw in ({}, kw):
        logp, _ = forward(model, params, IDS, readout=Readout.next_token(IDS), **plan_kw)
        full = forward(model, params, IDS, **plan_kw)[:, :-1]
        # The path: per block its norm, up (D) and down (F) sums; the final norm, the head, V.
        tol = bound(3 * (16 + 16 + 24) + 16 + 16 + 32, np.abs(np.asarray(full)).max())
        np.testing.assert_allclose(logp, logprobs_from_logits(full, tokens, 1.0)[0], atol=tol)
    clean, _ = forward(model, params, IDS, readout=Readout.next_token(IDS))
    assert np.abs(np.asarray(logp - clean)).max() > 0.1  # the fault moved them


def test_srdd_reads_the_familys_layers(toy):
    """SRDD's profile and probe scan on the toy family: the deadzone layer is the dead one."""
    model, params = toy
    mask = np.ones_like(IDS)
    outs = layer_outputs(model, params, IDS, mask)
    _, st = model.apply(
        {"params": params}, IDS, capture_intermediates=True, mutable=["intermediates"]
    )
    assert len(outs) == 3
    for i, h in enumerate(outs):
        np.testing.assert_array_equal(h, st["intermediates"][f"block{i}"]["__call__"][0][0])
    clean = scan_layers(model, params, IDS, mask)
    assert np.all(clean["dead"] == 0)
    plan = plan_of(Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5)))
    faulty = scan_layers(model, params, IDS, mask, plan=plan)
    assert faulty["dead"][1] > 0 and faulty["dead"][0] == 0 and faulty["dead"][2] == 0
