"""A model family brings its own names (`models/registry.py`): a throwaway family whose modules
are named as in Meta's Llama code (`blocks_{i}/attention/wq..wo`, `feed_forward/w1..w3`,
`attn_norm`, `mlp_norm`), registered here alone, gets fault sites, LoRA adapters and SRDD from
its registry entry. The negative controls: Qwen2's names find nothing in it, and without its
entry its names are refused.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from aqn_jax import lora as lora_lib
from aqn_jax.diagnosis import srdd
from aqn_jax.diagnosis.config import diagnosis_config
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import Deadzone, Noise, NoisyLinear, NormWeightNoise, Scale
from aqn_jax.forward import forward, trace_manifest
from aqn_jax.models import qwen2, registry

LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
NORMS = ("attn_norm", "mlp_norm", "norm")


@dataclasses.dataclass(frozen=True)
class LiteConfig:
    model_type: str = "lite"
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 3
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    tie_word_embeddings: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    logprob_chunk: int = 4


def _linear(features: int, name: str) -> nn.Module:
    return qwen2.Linear(features, False, (None, None), name=name)


def _norm(name: str) -> nn.Module:
    return qwen2.RMSNorm(1e-6, name=name)


class LiteAttention(nn.Module):
    """One-head causal attention over the real tokens."""

    config: LiteConfig

    @nn.compact
    def __call__(self, x_BTD, mask_BT):
        d = self.config.hidden_size
        q, k, v = (_linear(d, n)(x_BTD) for n in ("wq", "wk", "wv"))
        T = x_BTD.shape[1]
        allowed = jnp.tril(jnp.ones((T, T), bool))[None] & (mask_BT[:, None, :] > 0)
        s = jnp.where(allowed, jnp.einsum("btd,bsd->bts", q, k) * d**-0.5, -1e9)
        return _linear(d, "wo")(jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v))


class LiteMLP(nn.Module):
    config: LiteConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = nn.silu(_linear(c.intermediate_size, "w1")(x)) * _linear(c.intermediate_size, "w3")(x)
        return _linear(c.hidden_size, "w2")(h)


class LiteBlock(nn.Module):
    """A decoder layer: `(x, mask) -> (x, None)`."""

    config: LiteConfig

    @nn.compact
    def __call__(self, x, mask):
        h = x + LiteAttention(self.config, name="attention")(_norm("attn_norm")(x), mask)
        return h + LiteMLP(self.config, name="feed_forward")(_norm("mlp_norm")(h)), None


class LiteLM(nn.Module):
    config: LiteConfig
    head: str = "lm"

    @nn.compact
    def __call__(
        self, ids, attention_mask=None, positions=None, cache=None, last_only=False, hidden=False
    ):
        c = self.config
        mask = jnp.ones_like(ids) if attention_mask is None else attention_mask
        x = nn.Embed(c.vocab_size, c.hidden_size, name="tok_embeddings")(ids)
        for i in range(c.num_hidden_layers):
            x, _ = LiteBlock(c, name=f"blocks_{i}")(x, mask)
        x = _norm("final_norm")(x)
        if last_only:
            x = x[:, -1:]
        if hidden:
            return x
        return _linear(c.vocab_size, "output")(x).astype(jnp.float32)


_TOP = {"tok_embeddings": "embed_tokens", "final_norm": "norm", "output": "lm_head"}
_INNER = {
    ("attention",): "attention",
    ("feed_forward",): "feed_forward",
    **{("attention", k): k for k in ("wq", "wk", "wv", "wo")},
    **{("feed_forward", k): k for k in ("w1", "w2", "w3")},
    ("attn_norm",): "attn_norm",
    ("mlp_norm",): "mlp_norm",
}


def lite_site_of(path):
    if len(path) == 1 and path[0] in _TOP:
        return _TOP[path[0]], None
    if path and path[0].startswith("blocks_") and path[0][7:].isdigit():
        kind = "layer" if len(path) == 1 else _INNER.get(tuple(path[1:]))
        return None if kind is None else (kind, int(path[0][7:]))
    return None


LITE = registry.Family(
    model_types=("lite",),
    causal_lm=LiteLM,
    lm_head=None,
    init_cache=None,
    layer_name="blocks_{}".format,
    site_of=lite_site_of,
    site_types={
        "layer": LiteBlock,
        "attention": LiteAttention,
        "feed_forward": LiteMLP,
        **dict.fromkeys(LINEARS, qwen2.Linear),
        "attn_norm": qwen2.RMSNorm,
        "mlp_norm": qwen2.RMSNorm,
        "norm": qwen2.RMSNorm,
        "embed_tokens": nn.Embed,
        "lm_head": qwen2.Linear,
    },
    norm_with_weight=qwen2.norm_with_weight,
    saved_layer_bytes=None,
    forward_layer_bytes=None,
    checkpoint_keys=lambda config: {},
    config_from_hf=None,
    config_to_hf=None,
    linear_kinds=LINEARS,
    norm_kinds=NORMS,
    model_kinds=("norm", "embed_tokens", "lm_head"),
    explicit_only=("embed_tokens", "lm_head"),
    presets={"lite_tiny": LiteConfig},
)
CONFIG = LiteConfig()
IDS = np.random.RandomState(0).randint(3, 64, (3, 12)).astype(np.int32)
MASK = np.ones_like(IDS)
MASK[1, :3] = 0  # a left-padded row


@pytest.fixture
def lite():
    """The throwaway family registered, its model and random params; unregistered after."""
    model = LiteLM(CONFIG)
    params = nn.unbox(model.init(jax.random.key(0), IDS))["params"]
    registry.FAMILIES.register("lite", LITE)
    try:
        yield model, params
    finally:
        registry.FAMILIES.unregister("lite")


def _outputs(model, variables, plan=None):
    """Every block's output (the residual stream after it), with `plan` active in 'train'."""
    plan = plan or FaultPlan()
    with plan.apply("train", key=step_key(0, 0, "train")):
        _, st = model.apply(
            variables, IDS, attention_mask=MASK, capture_intermediates=True, mutable=True
        )
    return [np.asarray(st["intermediates"][f"blocks_{i}"]["__call__"][0][0]) for i in range(3)]


def test_the_family_is_registered_with_its_names(lite):
    assert "lite" in registry.FAMILIES and registry.family_of(CONFIG) is LITE
    assert isinstance(registry.causal_lm(CONFIG), LiteLM)
    assert set(LINEARS) <= set(registry.linear_kinds())
    assert set(registry.kinds()) >= set(LITE.site_types)
    # Its preset is found by name, as config.model.preset would be.
    from aqn_jax.models.factory import model_config

    section = ml_collections.ConfigDict(
        dict(preset="lite_tiny", hf_path="", num_layers=0, param_dtype="float32")
        | dict(dtype="float32", remat=False, logprob_chunk=4)
    )
    assert model_config(section) == CONFIG


def test_faults_hit_the_familys_sites(lite):
    model, params = lite
    dz = Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5), phases=("train",))
    noise = Injection("n", SiteSelector(("linear",)), Noise("absolute_gaussian", Scale(0.0)))
    wq = Injection(
        "q", SiteSelector(("wq", "attn_norm"), (2,)), Noise("absolute_gaussian", Scale(0.0))
    )
    hits = trace_manifest(FaultPlan([dz, noise, wq]), model, params, "train")
    assert hits["dz"] == ["layers_1/layer:output"]
    assert sorted(hits["n"]) == sorted(f"layers_{i}/{k}:output" for i in range(3) for k in LINEARS)
    assert sorted(hits["q"]) == ["layers_2/attn_norm:output", "layers_2/wq:output"]
    # The deadzone acts at block 1 only: block 0's output is unchanged, block 1's is flushed.
    clean = _outputs(model, {"params": params})
    faulty = _outputs(model, {"params": params}, FaultPlan([dz]))
    np.testing.assert_array_equal(faulty[0], clean[0])
    keep = np.abs(clean[1]) >= 0.5 * np.abs(clean[1]).max()
    np.testing.assert_array_equal(faulty[1], np.where(keep, clean[1], 0.0))
    assert 0 < keep.mean() < 1


def test_aqn_and_operator_faults_reach_the_familys_modules(lite):
    """AQN's norm-weight noise (QeRL's form) and a noisy linear select the family's own norm and
    linear kinds, though the family was registered after the transforms' module was imported;
    the noise at block 1's norms leaves block 0 bitwise and moves block 1."""
    model, params = lite
    aqn = Injection("aqn", SiteSelector(("rmsnorm",), (1,)), NormWeightNoise(Scale(0.1)))
    op = Injection("op", SiteSelector(("linear",), (2,)), NoisyLinear(Scale(0.1)))
    hits = trace_manifest(FaultPlan([aqn, op]), model, params, "train")
    assert sorted(hits["aqn"]) == ["layers_1/attn_norm:output", "layers_1/mlp_norm:output"]
    assert sorted(hits["op"]) == sorted(f"layers_2/{k}:output" for k in LINEARS)
    clean = _outputs(model, {"params": params})
    noisy = _outputs(model, {"params": params}, FaultPlan([aqn]))
    np.testing.assert_array_equal(noisy[0], clean[0])
    assert np.abs(noisy[1] - clean[1]).max() > 1e-4  # sigma 0.1 on weights of ~1: a real move
    # The negative control: at sigma 0 the same plan is the clean model.
    zero = Injection("aqn", SiteSelector(("rmsnorm",), (1,)), NormWeightNoise(Scale(0.0)))
    np.testing.assert_array_equal(
        _outputs(model, {"params": params}, FaultPlan([zero]))[1], clean[1]
    )


def test_qwen2_names_find_no_site_in_it(lite):
    """The negative control: Qwen2's kinds are known (Qwen2 is registered) but none lives in
    this model, so a plan aimed at them raises at trace time instead of running clean."""
    model, params = lite
    for kinds in (("q_proj",), ("down_proj",), ("input_layernorm", "post_attention_layernorm")):
        plan = FaultPlan(
            [Injection("x", SiteSelector(kinds), Noise("absolute_gaussian", Scale(0.0)))]
        )
        with pytest.raises(ValueError, match="matched no module: x"):
            trace_manifest(plan, model, params, "train")
    spec = lora_lib.LoraSpec(4, 8.0, qwen2.LINEAR_KINDS, True)
    trainable = lora_lib.init_trainable(spec, params, LITE.site_of, jax.random.key(0))
    assert trainable["lora"] == {}


def test_without_its_entry_its_names_are_refused(lite):
    registry.FAMILIES.unregister("lite")
    with pytest.raises(ValueError, match="unknown module kind 'wq'"):
        SiteSelector(("wq",))
    with pytest.raises(ValueError, match="model_type='lite'; allowed: .*qwen2"):
        registry.causal_lm(CONFIG)
    assert "lite_tiny" not in registry.presets()


def test_lora_adapts_the_familys_linears(lite):
    model, params = lite
    section = ml_collections.ConfigDict(
        dict(rank=4, alpha=8.0, target_modules="all-linear", train_norms=True)
    )
    spec = lora_lib.lora_spec(section)
    tr = lora_lib.init_trainable(spec, params, LITE.site_of, jax.random.key(1))
    got = {
        "/".join(k.key for k in p[:-1]) for p, _ in jax.tree_util.tree_leaves_with_path(tr["lora"])
    }
    want = {f"blocks_{i}/attention/{k}" for i in range(3) for k in ("wq", "wk", "wv", "wo")}
    want |= {f"blocks_{i}/feed_forward/{k}" for i in range(3) for k in ("w1", "w2", "w3")}
    assert got == want
    norms = {
        "/".join(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(tr["norms"])
    }
    assert norms == {f"blocks_{i}/{n}/weight" for i in range(3) for n in NORMS[:2]} | {
        "final_norm/weight"
    }
    # A fresh adapter (B = 0) leaves the outputs bitwise; a trained one moves them.
    base = forward(model, params, IDS, MASK)
    fresh = forward(model, lora_lib.weights(spec, params, tr), IDS, MASK)
    np.testing.assert_array_equal(np.asarray(fresh), np.asarray(base))
    tr["lora"] = jax.tree.map(lambda x: x + 0.1, tr["lora"])
    trained = forward(model, lora_lib.weights(spec, params, tr), IDS, MASK)
    assert np.abs(np.asarray(trained) - np.asarray(base)).max() > 1e-3


def test_srdd_locates_the_faulty_layer(lite):
    model, params = lite
    spec = srdd.SrddSpec.of(diagnosis_config(), 0.05)
    clean = srdd.diagnose(model, params, FaultPlan(), IDS, MASK, spec)
    assert clean["verdict"]["layers"] == []
    dz = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5))])
    report = srdd.diagnose(model, params, dz, IDS, MASK, spec)
    assert report["verdict"]["layers"] == [1]
    assert "dead" in report["suspects"][0]["evidence"]
