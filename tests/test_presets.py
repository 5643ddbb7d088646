"""Full-size presets under jax.eval_shape: parameter counts equal HF's, every param has axes."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from aqn_jax.models.hf import abstract_params
from aqn_jax.models.qwen2 import PRESETS, Qwen2Config, Qwen2ForCausalLM

# REFERENCE.md: HF's parameter count of each public checkpoint.
HF_PARAM_COUNTS = {
    "qwen2p5_0p5b": 494_032_768,
    "qwen2p5_1p5b": 1_543_714_304,
    "qwen2p5_3b": 3_085_938_688,
    "qwen2p5_7b": 7_615_616_512,
}
LOGICAL_AXES = {"embed", "heads", "kv_heads", "mlp", "vocab", "norm"}


@pytest.mark.parametrize("preset", sorted(HF_PARAM_COUNTS))
def test_param_count_equals_reference(preset):
    shapes = abstract_params(Qwen2Config.preset(preset))
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert count == HF_PARAM_COUNTS[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_param_has_logical_axes(preset):
    cfg = Qwen2Config.preset(preset)
    boxed = jax.eval_shape(
        lambda: Qwen2ForCausalLM(cfg).init(jax.random.key(0), np.zeros((1, 1), np.int32))
    )["params"]
    leaves = jax.tree_util.tree_leaves(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    assert len(leaves) == len(jax.tree_util.tree_leaves(abstract_params(cfg)))
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) <= LOGICAL_AXES
    specs = nn.get_partition_spec(boxed)
    assert tuple(specs["layers_0"]["self_attn"]["k_proj"]["kernel"]) == ("embed", "kv_heads")
    assert tuple(specs["layers_0"]["mlp"]["down_proj"]["kernel"]) == ("mlp", "embed")
    assert tuple(specs["embed_tokens"]["embedding"]) == ("vocab", "embed")


def test_module_paths_carry_layer_index():
    shapes = abstract_params(Qwen2Config.qwen2p5_1p5b())
    layers = sorted(k for k in shapes if k.startswith("layers_"))
    assert layers == sorted(f"layers_{i}" for i in range(28))
    assert set(shapes) == set(layers) | {"embed_tokens", "norm"}  # tied: lm_head has no params
    assert "kernel" in abstract_params(Qwen2Config.qwen2p5_7b())["lm_head"]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
        ("dtype", "float64", "Qwen2Config.dtype='float64'"),
        ("hidden_size", 0, "Qwen2Config.hidden_size=0"),
    ],
)
def test_bad_config_names_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Qwen2Config.tiny(**{field: value})


def test_unknown_preset():
    with pytest.raises(ValueError, match="model preset 'qwen9' is unknown"):
        Qwen2Config.preset("qwen9")


def test_num_layers_overrides_the_presets_depth_only():
    """config.model.num_layers: the preset at that depth, every width unchanged; 0 is the preset
    itself, and the warm start's cache key of the default config is the one it had before the
    field existed (the shipped warm start's); bad values and hf_path are refused by name."""
    from aqn_jax.models.config import model_section
    from aqn_jax.models.factory import model_config
    from aqn_jax.spec import warm_start_spec

    from conftest import load_config

    section = model_section()
    assert model_config(section) == Qwen2Config.tiny()
    section.num_layers = 3
    shallow = model_config(section)
    assert shallow == Qwen2Config.tiny(num_hidden_layers=3) != Qwen2Config.tiny()
    assert sorted(k for k in abstract_params(shallow) if k.startswith("layers_")) == [
        "layers_0",
        "layers_1",
        "layers_2",
    ]
    config = load_config("targeted")
    assert warm_start_spec(config).key == "0966d513ccd36516"  # aqn_jax/assets/sft-<this key>
    config.model.num_layers = 3
    assert warm_start_spec(config).key != "0966d513ccd36516"
    section.num_layers = -1  # (ConfigDict refuses a non-int itself)
    with pytest.raises(ValueError, match=r"config\.model\.num_layers=-1; allowed: an int >= 0"):
        model_config(section)
    section.num_layers, section.hf_path = 3, "/some/snapshot"
    with pytest.raises(ValueError, match="config.model.num_layers=3; applies to presets only"):
        model_config(section)
