"""Tests for aqn_jax.data.tokenizers.

The HF side is checked for exact parity against `transformers` on a tiny byte-level BPE
tokenizer trained here (no download) and saved with the real Qwen2.5-Instruct chat template, in
both on-disk layouts: newer transformers' `chat_template.jinja`, and the older Qwen snapshot
layout (template inside tokenizer_config.json, special tokens as AddedToken dicts).
"""

from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aqn_jax.data.tokenizers import (
    CHAR_TOKENIZER_FILE,
    DEFAULT_WORDS,
    INSTRUCTION_SUFFIX,
    SPECIAL_TOKENS,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

# The Qwen2.5-Instruct chat template, verbatim (ChatML with the default system prompt).
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

NAMES = ["Tom", "Ann", "Li", "Sara", "Omar", "Maya"]
OBJECTS = ["apples", "books", "marbles", "cookies", "pencils"]


def _corpus() -> list[str]:
    """A few dozen GSM8K-style problems and solutions to train the tiny BPE on."""
    lines = []
    for i in range(48):
        a, b = 3 + 7 * i % 50, 2 + 5 * i % 30
        name, obj = NAMES[i % len(NAMES)], OBJECTS[i % len(OBJECTS)]
        lines.append(
            f"{name} has {a} {obj} and buys {b} more. How many {obj} does {name} have?"
            + INSTRUCTION_SUFFIX
        )
        lines.append(f"{a} + {b} = {a + b}\n#### {a + b}")
    return lines


MESSAGE_LISTS = {
    "user_only": [{"role": "user", "content": "Tom has 12 apples and buys 7 more. How many?"}],
    "with_system": [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "What is 3 + 4?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "3 + 4 = 7\n#### 7"},
        {"role": "user", "content": "And 7 * 6? Café 🍎"},
    ],
    "late_system_and_none_value": [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "system", "content": "Late system note."},
        {"role": "assistant", "content": "Hello"},
    ],
}


def _added_token(content: str) -> dict:
    """transformers' AddedToken serialisation, as found in older tokenizer_config.json files."""
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two Qwen-style tokenizer directories built without any download.

    "jinja": what `save_pretrained` of transformers 5 writes (template in chat_template.jinja).
    "config": the older Qwen snapshot layout: template in tokenizer_config.json, eos/pad as
    AddedToken dicts, added_tokens_decoder present, no chat_template.jinja.
    """
    import transformers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    rust.train_from_iterator(_corpus(), trainer)
    rust.add_special_tokens(SPECIALS)  # appended after the BPE vocab, as in Qwen

    jinja_dir = tmp_path_factory.mktemp("qwen_like_jinja")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=rust,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN25_CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(jinja_dir))
    assert (jinja_dir / "chat_template.jinja").is_file()

    config_dir = tmp_path_factory.mktemp("qwen_like_config")
    shutil.copy(jinja_dir / "tokenizer.json", config_dir)
    config = json.loads((jinja_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["chat_template"] = QWEN25_CHAT_TEMPLATE
    config["bos_token"] = None
    config["eos_token"] = _added_token("<|im_end|>")
    config["pad_token"] = _added_token("<|endoftext|>")
    config["added_tokens_decoder"] = {str(rust.token_to_id(s)): _added_token(s) for s in SPECIALS}
    (config_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {"jinja": str(jinja_dir), "config": str(config_dir)}


@pytest.fixture(scope="module", params=["jinja", "config"])
def pair(request: pytest.FixtureRequest, hf_dirs: dict[str, str]):
    """(ours, transformers reference) loaded from the same directory."""
    import transformers

    path = hf_dirs[request.param]
    return HFTokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------------
# HFTokenizer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MESSAGE_LISTS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_chat_template_matches_transformers(pair, name: str, add_generation_prompt: bool):
    ours, ref = pair
    msgs = MESSAGE_LISTS[name]
    got = ours.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    want = ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert got == want
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = ours.encode_chat(msgs, add_generation_prompt=add_generation_prompt)
    assert ids == ref(want, add_special_tokens=False).input_ids
    assert ids[0] == ours.encode("<|im_start|>")[0]


def test_hf_chat_template_exact_default_system_prompt(pair):
    ours, _ = pair
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    im_start, im_end = ours.encode("<|im_start|>"), ours.encode("<|im_end|>")
    assert len(im_start) == 1 and len(im_end) == 1
    ids = ours.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(im_start[0]) == 3 and ids.count(im_end[0]) == 2


def test_hf_chat_template_tools_kwarg_matches_transformers(pair):
    ours, ref = pair
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "int <>&"}}}]
    msgs = MESSAGE_LISTS["user_only"]
    got = ours.apply_chat_template(msgs, tools=tools)
    assert got == ref.apply_chat_template(
        msgs, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert (
        '{"type": "function", "function": {"name": "add", "parameters": {"a": "int <>&"}}}' in got
    )


def test_hf_raise_exception_becomes_value_error(hf_dirs):
    from tokenizers import Tokenizer as RustTokenizer

    tok = HFTokenizer.from_pretrained(hf_dirs["jinja"])
    strict = HFTokenizer(
        RustTokenizer.from_file(os.path.join(hf_dirs["jinja"], "tokenizer.json")),
        chat_template="{{ raise_exception('only user turns, got ' + messages[0].role) }}",
        eos_token="<|im_end|>",
        name_or_path="strict-template",
    )
    with pytest.raises(ValueError, match="strict-template.*only user turns, got system"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        tok.apply_chat_template(["not a dict"])


TEXTS = [
    "Tom has 12 apples and buys 7 more. How many apples does he have?" + INSTRUCTION_SUFFIX,
    "12 + 7 = 19\n#### 19",
    "  leading spaces, tabs\tand\n\nnewlines  ",
    "Unicode: café, naïve, 数学, 🍎🍏",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_hf_encode_decode_match_transformers(pair, text: str):
    ours, ref = pair
    ids = ours.encode(text)
    assert ids == ref(text, add_special_tokens=False).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == text.replace("<|endoftext|>", "")
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(np.asarray(ids, dtype=np.int32)) == ours.decode(ids)


def test_hf_special_ids_and_vocab_size_match_transformers(pair):
    ours, ref = pair
    assert ours.eos_id == ref.eos_token_id == ref.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_id == ref.pad_token_id == ref.convert_tokens_to_ids("<|endoftext|>")
    assert ours.bos_id is None and ref.bos_token_id is None
    assert ours.vocab_size == len(ref)
    assert ours.vocab_size == max(ours.pad_id, ours.eos_id) + 1  # specials appended last
    assert isinstance(ours, Tokenizer)


def test_hf_decode_drops_pad_and_checks_range(pair):
    ours, _ = pair
    ids = ours.encode("12 + 7 = 19")
    padded = ids + [ours.eos_id] + [ours.pad_id] * 3
    assert ours.decode(padded, skip_special_tokens=False) == "12 + 7 = 19<|im_end|>"
    assert ours.decode(padded) == "12 + 7 = 19"
    with pytest.raises(ValueError, match=rf"token id {ours.vocab_size} at position 1"):
        ours.decode([ids[0], ours.vocab_size])
    with pytest.raises(ValueError, match="token id -1"):
        ours.decode([-1])
    with pytest.raises(ValueError, match=r"shape \(1, 2\)"):
        ours.decode(np.zeros((1, 2), dtype=np.int32))
    assert ours.decode([]) == ""


def test_hf_encode_batch(pair):
    ours, _ = pair
    batch = ours.encode_batch(TEXTS)
    assert batch == [ours.encode(t) for t in TEXTS]
    assert [len(b) > 0 for b in batch] == [True] * (len(TEXTS) - 1) + [False]


def test_hf_pad_falls_back_to_eos(hf_dirs, tmp_path):
    d = tmp_path / "nopad"
    d.mkdir()
    shutil.copy(os.path.join(hf_dirs["jinja"], "tokenizer.json"), d)
    cfg = {"eos_token": "<|im_end|>", "chat_template": "{{ messages[0].content }}"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = HFTokenizer.from_pretrained(d)
    assert tok.pad_id == tok.eos_id == tok.encode("<|im_end|>")[0]
    assert tok.apply_chat_template([{"role": "user", "content": "x7"}]) == "x7"


def test_hf_errors_name_the_path(hf_dirs, tmp_path):
    missing = tmp_path / "does_not_exist"
    with pytest.raises(FileNotFoundError, match="does_not_exist.*does not exist"):
        HFTokenizer.from_pretrained(missing)

    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing.*empty_dir"):
        HFTokenizer.from_pretrained(empty)

    no_template = tmp_path / "no_template"
    no_template.mkdir()
    src = hf_dirs["jinja"]
    shutil.copy(os.path.join(src, "tokenizer.json"), no_template)
    (no_template / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"no chat template.*no_template.*chat_template\.jinja"):
        HFTokenizer.from_pretrained(no_template)

    bad_eos = tmp_path / "bad_eos"
    bad_eos.mkdir()
    shutil.copy(os.path.join(src, "tokenizer.json"), bad_eos)
    cfg = {"eos_token": "<|nope|>", "chat_template": "x"}
    (bad_eos / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
        HFTokenizer.from_pretrained(bad_eos)


# ---------------------------------------------------------------------------------------------
# CharTokenizer
# ---------------------------------------------------------------------------------------------

N_SPECIAL = 7
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]


def char_id(c: str) -> int:
    """Expected id of a single character: after the 7 specials and the default words."""
    return N_SPECIAL + len(DEFAULT_WORDS) + CHARS.index(c)


@pytest.fixture(scope="module")
def ct() -> CharTokenizer:
    return CharTokenizer()


def test_char_vocab_layout(ct: CharTokenizer):
    assert len(CHARS) == 97 and " " in CHARS and "\n" in CHARS and "\t" in CHARS
    assert ct.vocab_size == N_SPECIAL + len(DEFAULT_WORDS) + 97 == 178
    assert ct.vocab_size <= 256  # the embedded tiny model's vocabulary
    assert SPECIAL_TOKENS == (
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<|user|>",
        "<|assistant|>",
        "<|system|>",
    )
    assert (ct.pad_id, ct.eos_id, ct.bos_id, ct.unk_id) == (0, 1, 2, 3)
    assert [ct.token_to_id(t) for t in ("<|user|>", "<|assistant|>", "<|system|>")] == [4, 5, 6]
    assert ct.token_to_id("####") == 7 and ct.token_to_id(INSTRUCTION_SUFFIX) == 8
    assert ct.token_to_id("0") == 81 == char_id("0")
    assert ct.token_to_id(" ") == 175 and ct.token_to_id("\n") == 177
    assert len(set(ct.vocab)) == ct.vocab_size


def test_char_encode_hand_checked(ct: CharTokenizer):
    assert ct.encode("#### 19") == [7, char_id(" "), char_id("1"), char_id("9")]
    assert ct.encode("#### 19") == [7, 175, 82, 90]
    assert ct.encode(INSTRUCTION_SUFFIX) == [8]
    q = "Tom has 12 apples." + INSTRUCTION_SUFFIX
    has, apples = ct.token_to_id(" has"), ct.token_to_id(" apples")
    expected = [char_id("T"), char_id("o"), char_id("m"), has, char_id(" ")]
    expected += [char_id("1"), char_id("2"), apples, char_id("."), 8]
    assert ct.encode(q) == expected
    # Greedy longest match: " How many" wins over " How much"'s shared prefix and " he".
    assert ct.encode(" How many") == [ct.token_to_id(" How many")]
    assert ct.encode(" hen") == [ct.token_to_id(" he"), char_id("n")]
    # Special-token text maps to the special id; unknown characters to <unk>.
    assert ct.encode("<eos><|assistant|>") == [1, 5]
    assert ct.encode("a€b\r") == [char_id("a"), 3, char_id("b"), 3]
    assert ct.decode(ct.encode("a€b")) == "ab"
    assert ct.decode(ct.encode("a€b"), skip_special_tokens=False) == "a<unk>b"


def test_unknown_chars_are_named(ct: CharTokenizer, hf_dirs):
    """`unknown_chars`: what encodes as `unk_id` (config.data.instruction's check), each once;
    none for a byte-level BPE (no unk) or printable ASCII in the embedded tokenizer."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    assert ct.unknown_chars(" Réponds: 日本語 🙂 é\r") == ["é", "日", "本", "語", "🙂", "\r"]
    assert ct.unknown_chars(INSTRUCTION_SUFFIX + " Reponds: ####") == []
    hf = HFTokenizer.from_pretrained(hf_dirs["jinja"])
    assert hf.unk_id is None and hf.unknown_chars(" Réponds: 日本語 🙂") == []
    words = RustTokenizer(models.WordLevel({"a": 0, "<unk>": 1, "<eos>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    with_unk = HFTokenizer(words, "{{ messages }}", eos_token="<eos>", unk_token="<unk>")
    assert with_unk.unk_id == 1 and with_unk.unknown_chars("abca") == ["b", "c"]


def test_char_decode_specials_and_arrays(ct: CharTokenizer):
    ids = ct.encode("<|user|>1 + 2<eos>") + [0, 0]
    assert ids == [4, char_id("1"), 175, char_id("+"), 175, char_id("2"), 1, 0, 0]
    assert ct.decode(ids) == "1 + 2"
    assert ct.decode(ids, skip_special_tokens=False) == "<|user|>1 + 2<eos>"
    assert ct.decode(np.asarray(ids, dtype=np.int64)) == "1 + 2"
    with pytest.raises(ValueError, match="token id 178 at position 0.*vocabulary \\[0, 178\\)"):
        ct.decode([178])
    with pytest.raises(ValueError, match="integer token ids"):
        ct.decode(np.asarray([1.0, 2.0]))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(CHARS), max_size=200))
def test_char_roundtrip_printable(s: str):
    tok = CharTokenizer()
    # Special-token text is encoded as the special id (like HF tokenizers), which decode skips;
    # hypothesis does generate e.g. "<|system|>", so exclude exactly those strings.
    assume(not any(sp in s for sp in SPECIAL_TOKENS))
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert len(ids) <= len(s)
    assert all(0 <= i < tok.vocab_size and i != tok.unk_id for i in ids)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            list(DEFAULT_WORDS) + CHARS + ["<eos>", "<|user|>", "<|assistant|>", "<", "|>"]
        ),
        max_size=60,
    )
)
def test_char_roundtrip_words_and_specials(pieces: list[str]):
    tok = CharTokenizer()
    s = "".join(pieces)
    assume("<pad>" not in s)
    ids = tok.encode(s)
    assert tok.decode(ids, skip_special_tokens=False) == s
    assert len(ids) <= len(s)


def test_char_chat_template_exact(ct: CharTokenizer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tom has 3 apples. How many?"},
        {"role": "assistant", "content": "#### 3"},
        {"role": "user", "content": "2 + 2?"},
    ]
    assert ct.apply_chat_template(msgs) == (
        "<|system|>Be brief.<eos><|user|>Tom has 3 apples. How many?<eos>"
        "<|assistant|>#### 3<eos><|user|>2 + 2?<eos><|assistant|>"
    )
    assert (
        ct.apply_chat_template(msgs[:1], add_generation_prompt=False) == "<|system|>Be brief.<eos>"
    )
    one = [{"role": "user", "content": "2+2"}]
    assert ct.encode_chat(one) == [4, char_id("2"), char_id("+"), char_id("2"), 1, 5]
    assert ct.encode_chat(one, add_generation_prompt=False) == [4, 83, char_id("+"), 83, 1]
    assert ct.encode_chat(msgs) == ct.encode(ct.apply_chat_template(msgs))
    with pytest.raises(ValueError, match=r"messages\[1\]\['role'\] = 'tool'.*'assistant'"):
        ct.apply_chat_template([one[0], {"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] must be a string"):
        ct.apply_chat_template([{"role": "user", "content": 5}])


def test_char_encode_batch(ct: CharTokenizer):
    assert ct.encode_batch(["#### 19", "", INSTRUCTION_SUFFIX]) == [[7, 175, 82, 90], [], [8]]


def test_char_save_load_and_dict(tmp_path):
    tok = CharTokenizer(words=(*DEFAULT_WORDS, " pears", " pear"))
    assert tok.vocab_size == 180 and tok.token_to_id(" pears") == 81
    assert tok.encode(" pears") == [81] and tok.encode(" pear") == [82]
    file = tok.save(tmp_path / "run")
    assert file == tmp_path / "run" / CHAR_TOKENIZER_FILE and file.is_file()
    loaded = CharTokenizer.load(tmp_path / "run")
    assert loaded == tok and loaded != CharTokenizer()
    assert loaded.vocab == tok.vocab and loaded.words == tok.words
    assert CharTokenizer.load(file).encode(" pears") == [81]
    data = json.loads(json.dumps(tok.to_dict()))
    assert data["type"] == "char" and len(data["vocab"]) == 180
    assert CharTokenizer.from_dict(data) == tok
    data["vocab"][100] = "?"
    with pytest.raises(ValueError, match="differs from the rebuilt one at id 100"):
        CharTokenizer.from_dict(data)
    with pytest.raises(ValueError, match="expected type 'char', got 'bpe'"):
        CharTokenizer.from_dict({"type": "bpe"})
    with pytest.raises(FileNotFoundError, match="char_tokenizer.json"):
        CharTokenizer.load(tmp_path / "nothing")


def test_char_bad_words():
    with pytest.raises(ValueError, match=r"words\[1\] = ' has' is duplicated"):
        CharTokenizer(words=(" has", " has"))
    with pytest.raises(ValueError, match=r"words\[0\] = 'x'.*>= 2 characters"):
        CharTokenizer(words=("x",))
    with pytest.raises(ValueError, match="collides with a special token"):
        CharTokenizer(words=("<eos>",))


# ---------------------------------------------------------------------------------------------
# load_tokenizer
# ---------------------------------------------------------------------------------------------


def test_load_tokenizer_dispatch(hf_dirs, tmp_path):
    for empty in (None, ""):
        tok = load_tokenizer(empty)
        assert isinstance(tok, CharTokenizer) and tok.vocab_size == 178

    hf = load_tokenizer(hf_dirs["jinja"])
    assert isinstance(hf, HFTokenizer)
    assert hf.encode("#### 19") == HFTokenizer.from_pretrained(hf_dirs["jinja"]).encode("#### 19")

    custom = CharTokenizer(words=(*DEFAULT_WORDS, " pears"))
    custom.save(tmp_path / "char")
    got = load_tokenizer(str(tmp_path / "char"))
    assert isinstance(got, CharTokenizer) and got.vocab_size == 179 and got == custom
    assert load_tokenizer(tmp_path / "char" / CHAR_TOKENIZER_FILE) == custom

    (tmp_path / "neither").mkdir()
    with pytest.raises(ValueError, match=r"neither\b.*holds neither tokenizer\.json"):
        load_tokenizer(tmp_path / "neither")
    with pytest.raises(FileNotFoundError, match="missing_dir.*is not a directory"):
        load_tokenizer(tmp_path / "missing_dir")


def test_module_does_not_import_transformers(hf_dirs):
    """Rollout workers import this module; transformers alone takes seconds to import."""
    code = (
        "import sys\n"
        "from aqn_jax.data.tokenizers import load_tokenizer\n"
        f"tok = load_tokenizer({hf_dirs['jinja']!r})\n"
        "print(len(tok.encode_chat([{'role': 'user', 'content': 'hi'}])))\n"
        "print('transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert int(out[0]) > 10
    assert out[1:] == ["False", "False"]


def _snapshot_with_ordinary_s(root, eos, config=None, generation=None):
    """A tokenizer whose vocabulary holds `</s>` as an ordinary word (as Qwen's does, id 128247)
    beside the special `<|im_end|>` and `<|endoftext|>`; `eos` in tokenizer_config.json, and a
    config.json / generation_config.json stating the model's eos ids, when given."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    root.mkdir()
    words = {"a": 0, "b": 1, "</s>": 2, "<unk>": 3}
    rust = RustTokenizer(models.WordLevel(words, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.add_special_tokens(["<|endoftext|>", "<|im_end|>"])  # ids 4, 5
    rust.save(str(root / "tokenizer.json"))
    cfg = {"eos_token": eos, "chat_template": "{{ messages[0].content }}"}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, ids in (("config.json", config), ("generation_config.json", generation)):
        if ids is not None:
            (root / name).write_text(json.dumps({"eos_token_id": ids}))
    return root


def test_hf_eos_must_be_a_special_token_the_model_ends_on(tmp_path):
    # transformers 5.17's GGUF fallback wrote eos "</s>" for Qwen2.5 (an ordinary token): every
    # response ran to the cap. Refused in one line naming the files and the ids.
    bad = _snapshot_with_ordinary_s(tmp_path / "bad", "</s>", config=5)
    with pytest.raises(
        ValueError,
        match=r"eos_token '</s>' \(id 2, tokenizer_config.json\) is an ordinary vocabulary"
        r" token.*config.json eos_token_id \[5\]",
    ):
        HFTokenizer.from_pretrained(bad)
    # With no model config at all, an ordinary eos is still refused.
    with pytest.raises(ValueError, match="is an ordinary vocabulary token"):
        HFTokenizer.from_pretrained(_snapshot_with_ordinary_s(tmp_path / "bare", "</s>"))
    # A special token, but not the one the model's config ends a turn on.
    other = _snapshot_with_ordinary_s(tmp_path / "other", "<|endoftext|>", config=5)
    with pytest.raises(ValueError, match=r"id 4.*not an id the model ends a turn on"):
        HFTokenizer.from_pretrained(other)
    # The model's eos: accepted, and the generation config's ids are the stop ids (eos first).
    good = _snapshot_with_ordinary_s(tmp_path / "good", "<|im_end|>", config=5, generation=[5, 4])
    tok = HFTokenizer.from_pretrained(good)
    assert (tok.eos_id, tok.stop_ids) == (5, (5, 4))
    alone = HFTokenizer.from_pretrained(_snapshot_with_ordinary_s(tmp_path / "alone", "<|im_end|>"))
    assert alone.stop_ids == (5,)
