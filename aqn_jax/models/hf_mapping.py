"""The table between HF Qwen2 checkpoint keys and our Flax param paths (Llama: the same table
without the q/k/v bias rows).

One row per tensor kind: `(hf_key, flax_path, transpose)`, with `{i}` standing for the layer
index. `transpose` is True for linear weights, which HF stores as `[out, in]` (torch
`nn.Linear.weight`) and we store as `kernel [in, out]`.
"""

from __future__ import annotations

from .qwen2 import Qwen2Config

# Per-model tensors.
GLOBAL_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("model.embed_tokens.weight", "embed_tokens/embedding", False),
    ("model.norm.weight", "norm/weight", False),
)
# Only when tie_word_embeddings is false.
UNTIED_ROWS: tuple[tuple[str, str, bool], ...] = (("lm_head.weight", "lm_head/kernel", True),)
# Per decoder layer.
LAYER_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.input_layernorm.weight", "layers_{i}/input_layernorm/weight", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj/kernel", True),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers_{i}/self_attn/q_proj/bias", False),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers_{i}/self_attn/k_proj/kernel", True),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers_{i}/self_attn/k_proj/bias", False),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers_{i}/self_attn/v_proj/kernel", True),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers_{i}/self_attn/v_proj/bias", False),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj/kernel", True),
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "layers_{i}/post_attention_layernorm/weight",
        False,
    ),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers_{i}/mlp/gate_proj/kernel", True),
    ("model.layers.{i}.mlp.up_proj.weight", "layers_{i}/mlp/up_proj/kernel", True),
    ("model.layers.{i}.mlp.down_proj.weight", "layers_{i}/mlp/down_proj/kernel", True),
)
# Keys some older checkpoints carry that hold derived buffers, not parameters; dropped.
DERIVED_KEY_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


def checkpoint_keys(config: Qwen2Config) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Every HF key this config's checkpoint must hold -> (flax path as a tuple, transpose)."""
    rows = list(GLOBAL_ROWS)
    if not config.tie_word_embeddings:
        rows += UNTIED_ROWS
    table = {hf: (tuple(path.split("/")), t) for hf, path, t in rows}
    layer_rows = [r for r in LAYER_ROWS if config.attention_bias or not r[0].endswith(".bias")]
    for i in range(config.num_hidden_layers):
        for hf, path, t in layer_rows:
            table[hf.format(i=i)] = (tuple(path.format(i=i).split("/")), t)
    return table
