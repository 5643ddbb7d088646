"""One linear contract (`registry.Family.linear_operands` / `linear_product`): the model and the
faults that redo or probe a linear compute it the family's way.

The throwaway family below has a Linear that differs from Qwen2's: no bias and a kernel scaled
by `SCALE` before the product (`y = x (SCALE W)`). A fault that read the module as Qwen2's
Linear (its `kernel` multiplied as stored) would be wrong by that factor in silence; here the
operator-level noisy linear, a bit fault on dW and ABFT follow the family, each checked against
the product computed by hand from the scaled kernel, with Qwen2's reading as the negative
control.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax.faults import bitfaults, ops
from aqn_jax.faults.bitfaults import Abft, BitFault, BitsLinear
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import STATS_COLLECTION, NoisyLinear, Scale
from aqn_jax.models import qwen2, registry

SCALE = 3.0
HI = jax.lax.Precision.HIGHEST
D, V = 8, 16


@dataclasses.dataclass(frozen=True)
class ScaledConfig:
    model_type: str = "scaled"
    vocab_size: int = V
    hidden_size: int = D
    intermediate_size: int = D
    num_hidden_layers: int = 1
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    tie_word_embeddings: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    logprob_chunk: int = 2


def scaled_operands(module, x):
    """The family's operands: no bias, the stored kernel times SCALE (the matrix multiplied).
    Declared only where missing: a check after the module's call reads them again."""
    if module.has_variable("params", "kernel"):
        kernel = module.get_variable("params", "kernel")
    else:
        init = nn.initializers.normal(stddev=0.5)
        kernel = module.param("kernel", init, (x.shape[-1], module.features))
    return x, SCALE * kernel, None, None


def scaled_product(x, kernel, bias=None, lora=None):
    assert bias is None and lora is None
    return jnp.einsum("...i,io->...o", x, kernel, precision=HI)


class ScaledLinear(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return scaled_product(*scaled_operands(self, x))


class ScaledBlock(nn.Module):
    """A decoder layer `(x) -> (y, kv)` that is one linear: its output is the logits, so the
    cotangent at the linear's output is the loss's own."""

    @nn.compact
    def __call__(self, x):
        return ScaledLinear(V, name="down_proj")(x), None


class ScaledLM(nn.Module):
    config: ScaledConfig
    head: str = "lm"

    @nn.compact
    def __call__(self, ids, attention_mask=None, positions=None, cache=None, last_only=False):
        x = nn.Embed(V, D, name="embed_tokens")(ids)
        y, _ = ScaledBlock(name="block0")(x)
        return y


def scaled_site_of(path):
    if path == ("embed_tokens",):
        return "embed_tokens", None
    if path == ("block0",):
        return "layer", 0
    if path == ("block0", "down_proj"):
        return "down_proj", 0
    return None


def family(**contract):
    return registry.Family(
        model_types=("scaled",),
        causal_lm=ScaledLM,
        lm_head=None,
        init_cache=None,
        layer_name="block{}".format,
        site_of=scaled_site_of,
        site_types={"layer": ScaledBlock, "down_proj": ScaledLinear, "embed_tokens": nn.Embed},
        norm_with_weight=None,
        saved_layer_bytes=None,
        forward_layer_bytes=None,
        checkpoint_keys=lambda config: {},
        config_from_hf=None,
        config_to_hf=None,
        linear_kinds=("down_proj",),
        norm_kinds=(),
        model_kinds=("embed_tokens",),
        explicit_only=("embed_tokens",),
        presets={},
        **contract,
    )


SCALED = family(linear_operands=scaled_operands, linear_product=scaled_product)
IDS = np.array([[3, 7, 1, 9], [4, 4, 2, 15]], np.int32)
G = np.random.default_rng(0).standard_normal((2, 4, V)).astype(np.float32)
SEEN = []  # (x, key, out) of each recorded linear call


@dataclasses.dataclass(frozen=True, eq=False)
class RecordedNoisyLinear(NoisyLinear):
    def __call__(self, module, args, ctx):
        out = super().__call__(module, args, ctx)
        SEEN.append((args[0], ctx.key, out))
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class RecordedKey(BitsLinear):
    def __call__(self, module, args, ctx):
        SEEN.append((None, ctx.key, None))
        return super().__call__(module, args, ctx)


@pytest.fixture
def scaled():
    """The throwaway family registered, its model and params; unregistered after."""
    SEEN.clear()
    registry.FAMILIES.register("scaled", SCALED)
    try:
        model = registry.causal_lm(ScaledConfig())
        params = model.init(jax.random.key(0), IDS)["params"]
        yield model, params
    finally:
        registry.FAMILIES.unregister("scaled")


def run(model, params, transform, grad=False):
    """Logits (or the gradient of `sum(logits * G)`) with `transform` at block 0's linear."""
    plan = FaultPlan([Injection("f", SiteSelector(("down_proj",)), transform)])
    with plan.apply("train", key=step_key(0, 0, "train")):
        if grad:
            return jax.grad(lambda p: jnp.sum(model.apply({"params": p}, IDS) * G))(params)
        return model.apply({"params": params}, IDS)


def kernel_of(params):
    return np.asarray(params["block0"]["down_proj"]["kernel"])


def embedded(params):
    return np.asarray(params["embed_tokens"]["embedding"])[IDS]


def test_the_model_computes_the_contract(scaled):
    model, params = scaled
    x, w = embedded(params), kernel_of(params)
    y = np.asarray(model.apply({"params": params}, IDS))
    np.testing.assert_array_equal(y, np.asarray(scaled_product(x, SCALE * w)))
    operands, product = registry.linear_of(ScaledLinear(V, parent=None))
    assert (operands, product) == (scaled_operands, scaled_product)
    # Qwen2's Linear keeps its own, found by its type.
    assert registry.linear_of(qwen2.Linear(4, False, (None, None), parent=None)) == (
        qwen2.linear_operands,
        qwen2.linear_product,
    )


def test_noisy_linear_forward_follows_the_family(scaled):
    model, params = scaled
    x, w = embedded(params), kernel_of(params)
    clean = np.asarray(model.apply({"params": params}, IDS))
    # Scale 0: the family's computation exactly.
    zero = run(model, params, RecordedNoisyLinear(Scale(0.0), forward=True, backward=False))
    np.testing.assert_array_equal(np.asarray(zero), clean)
    SEEN.clear()
    noisy = np.asarray(run(model, params, NoisyLinear(Scale(0.1), backward=False)))
    SEEN.clear()
    recorded = np.asarray(
        run(model, params, RecordedNoisyLinear(Scale(0.1), forward=True, backward=False))
    )
    np.testing.assert_array_equal(recorded, noisy)
    (seen_x, key, out), *rest = SEEN
    assert not rest
    np.testing.assert_array_equal(np.asarray(seen_x), x)
    # By hand: y = x (SCALE W), then the relative error of y (key folded with 0).
    y = jnp.einsum("...i,io->...o", x, SCALE * w, precision=HI)
    hand = y + ops.noise_error("relative_gaussian", y, 0.1, jax.random.fold_in(key, 0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(hand))
    np.testing.assert_array_equal(noisy, np.asarray(hand))
    assert np.abs(noisy - clean).max() > 1e-3  # the error is there
    # Negative control: the same fault with Qwen2's product of the stored kernel.
    as_qwen2 = ops.noisy_linear(x, w, None, key, 0.1, backward=False, product=qwen2.linear_product)
    assert np.abs(np.asarray(as_qwen2) - noisy).max() > 0.5 * np.abs(noisy).max()


def test_noisy_linear_backward_follows_the_family(scaled):
    model, params = scaled
    x = embedded(params)
    transform = RecordedNoisyLinear(Scale(0.1), forward=False, backward=True)
    grads = run(model, params, transform, grad=True)
    (_, key, _), *rest = SEEN
    assert not rest
    dk = np.asarray(grads["block0"]["down_proj"]["kernel"])
    # By hand: dW of the matrix multiplied (x^T g) with its relative error (fold 2), then the
    # chain rule through the family's scaling.
    x_ND, g_NO = x.reshape(-1, D), G.reshape(-1, V)
    dw = jnp.einsum("ni,no->io", x_ND, g_NO, preferred_element_type=jnp.float32, precision=HI)
    err = jax.random.normal(jax.random.fold_in(key, 2), dw.shape, jnp.float32) * jnp.abs(dw)
    hand = np.asarray(SCALE * (dw + err * 0.1))
    np.testing.assert_allclose(dk, hand, rtol=1e-6, atol=1e-6)
    clean = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, IDS) * G))(params)
    clean_dk = np.asarray(clean["block0"]["down_proj"]["kernel"])
    np.testing.assert_allclose(clean_dk, SCALE * np.asarray(dw), rtol=1e-6, atol=1e-6)
    assert np.abs(dk - clean_dk).max() > 1e-2  # the error is there
    # Negative control: Qwen2's reading (the stored kernel is the matrix) gives dW unscaled.
    assert np.abs(hand / SCALE - dk).max() > 0.5 * np.abs(dk).max()


def test_bit_fault_on_dw_follows_the_family(scaled):
    """The sign bit of every element of dW flipped (rate 1: a mask known by hand)."""
    model, params = scaled
    x, w = embedded(params), kernel_of(params)
    transform = RecordedKey(BitFault("flip", bits=(31,), rate=1.0), which="dw")
    grads = run(model, params, transform, grad=True)
    assert len(SEEN) == 1
    dk = np.asarray(grads["block0"]["down_proj"]["kernel"])
    dw = np.einsum("ni,no->io", x.reshape(-1, D), G.reshape(-1, V))
    np.testing.assert_allclose(dk, -SCALE * dw, rtol=1e-5, atol=1e-5)
    # Its forward is the family's product of the scaled kernel, unchanged by the fault.
    out = run(model, params, transform)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(scaled_product(x, SCALE * w)))
    # Negative control: Qwen2's product of the stored kernel, under the same fault.
    mask = jnp.full((D, V), 1 << 31, jnp.uint32)

    def qwen2_loss(k):
        y = bitfaults._sdc_linear(
            "dw", "flip", (0, 0), qwen2.linear_product, x, k, None, None, mask, None
        )
        return jnp.sum(y * G)

    as_qwen2 = jax.grad(qwen2_loss)(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(as_qwen2), -dw, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(as_qwen2) - dk).max() > 0.5 * np.abs(dk).max()


def test_abft_checks_the_matrix_multiplied(scaled):
    model, params = scaled
    x, w = embedded(params), kernel_of(params)
    plan = FaultPlan([Injection("abft", SiteSelector(("down_proj",)), Abft())])
    with plan.apply("train", key=step_key(0, 0, "train")):
        out, state = model.apply({"params": params}, IDS, mutable=[STATS_COLLECTION])
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(state)
    }
    detected = [v for k, v in flat.items() if "abft.detected" in k]
    rows = [v for k, v in flat.items() if "abft.rows" in k]
    assert len(detected) == len(rows) == 1, flat
    assert float(np.sum(detected)) == 0.0 and float(np.sum(rows)) == 8.0
    # Negative control: the checksum of the stored kernel flags every row of the clean output.
    flagged, _, _ = bitfaults.abft_check(jnp.asarray(x), jnp.asarray(w), None, out)
    assert int(np.sum(flagged)) == 8


def test_a_family_without_the_contract_gets_no_op_level_linear_fault(scaled):
    """Its linears are refused by name, not redone as Qwen2's."""
    model, params = scaled
    registry.FAMILIES.unregister("scaled")
    registry.FAMILIES.register("scaled", family())
    with pytest.raises(TypeError, match="ScaledLinear is no registered family's linear"):
        run(model, params, NoisyLinear(Scale(0.1)))
