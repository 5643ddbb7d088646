"""Tests for the synthetic arithmetic task, the GSM8K loaders and the prompt batcher."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aqn_jax.data.arithmetic import (
    DATA_SOURCE,
    TASK_WORDS,
    TEST_FRACTION,
    ArithmeticTask,
    split_of,
)
from aqn_jax.data.gsm8k import (
    Example,
    PromptBatcher,
    extract_gsm8k_answer,
    load_examples,
    load_gsm8k_jsonl,
    load_verl_parquet,
)
from aqn_jax.data.tokenizers import DEFAULT_WORDS, INSTRUCTION_SUFFIX, CharTokenizer, HFTokenizer

EQUATION = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _equations(answer: str) -> tuple[list[tuple[int, str, int, int]], str]:
    """Parse a worked solution into (left, op, right, result) lines and the '#### N' value."""
    *lines, final = answer.split("\n")
    assert final.startswith("#### "), answer
    parsed = []
    for line in lines:
        m = EQUATION.match(line)
        assert m, f"not an equation line: {line!r} in {answer!r}"
        parsed.append((int(m[1]), m[2], int(m[3]), int(m[4])))
    return parsed, final[len("#### ") :]


# ----------------------------------------------------------------------------------------------
# Arithmetic task
# ----------------------------------------------------------------------------------------------


def test_task_validates_knobs_and_arguments():
    with pytest.raises(ValueError, match=r"ArithmeticTask\.digits = 0 .* 1\.\.4"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match=r"ArithmeticTask\.steps = 5 .* 1\.\.4"):
        ArithmeticTask(steps=5)
    with pytest.raises(ValueError, match=r"ArithmeticTask\.seed"):
        ArithmeticTask(seed=-1)
    with pytest.raises(ValueError, match=r"ArithmeticTask\.digits must be an integer"):
        ArithmeticTask(digits=2.0)
    with pytest.raises(ValueError, match=r"split = 'val' .*\['test', 'train'\]"):
        ArithmeticTask().example(0, "val")
    with pytest.raises(ValueError, match=r"index = -1"):
        ArithmeticTask().example(-1, "train")


def test_task_is_deterministic_and_pinned():
    a = ArithmeticTask(seed=0).dataset("train", 50)
    b = ArithmeticTask(seed=0).dataset("train", 50)
    assert a == b
    # Pinned: the cached SFT warm-start and published numbers depend on this exact stream.
    assert a[0] == {
        "question": "Jack has 2 bags with 11 candies in each. Then he gets 83 more candies from "
        "Max. How many candies does he have in the end?",
        "answer": "2 * 11 = 22\n22 + 83 = 105\n#### 105",
        "ground_truth": "105",
    }
    other_seed = ArithmeticTask(seed=1).dataset("train", 50)
    assert sum(x["question"] != y["question"] for x, y in zip(a, other_seed, strict=True)) >= 48
    # Index-addressable: example i does not depend on which other examples were drawn.
    assert ArithmeticTask(seed=0).example(37, "train") == a[37]


def test_worked_solutions_are_correct_across_knobs():
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    checked = 0
    for digits, steps in itertools.product(range(1, 5), range(1, 5)):
        task = ArithmeticTask(digits=digits, steps=steps, seed=3)
        for split in ("train", "test"):
            for ex in task.dataset(split, 32):
                lines, final = _equations(ex["answer"])
                assert len(lines) == steps
                for i, (left, op, right, result) in enumerate(lines):
                    if op == "/":
                        assert left % right == 0, ex  # exact division only
                        assert left // right == result
                    else:
                        assert ops[op](left, right) == result, ex
                    assert result >= 1
                    if i > 0:
                        assert left == lines[i - 1][3], ex  # each step uses the previous result
                    assert str(right) in ex["question"]
                assert final == ex["ground_truth"] == str(lines[-1][3])
                assert ex["question"].endswith("?")
                checked += 1
    assert checked == 1024


def test_train_and_test_splits_are_disjoint():
    task = ArithmeticTask()
    train, test = task.dataset("train", 3000), task.dataset("test", 3000)
    train_q = {e["question"] for e in train}
    test_q = {e["question"] for e in test}
    assert len(train_q) > 2990 and len(test_q) > 2990
    assert not train_q & test_q
    # Stronger: not even the arithmetic chain (same numbers, other names) is shared.
    chain = lambda e: e["answer"].rsplit("\n", 1)[0]
    assert not {chain(e) for e in train} & {chain(e) for e in test}
    assert all(split_of(chain(e)) == "train" for e in train)
    assert all(split_of(chain(e)) == "test" for e in test)
    # The smallest problem space has under 200 chains, so 1000 draws per split repeat each one
    # many times (without the split guarantee ~160 chains would be shared); still none is.
    tiny = ArithmeticTask(digits=1, steps=1)
    tiny_train = {chain(e) for e in tiny.dataset("train", 1000)}
    tiny_test = {chain(e) for e in tiny.dataset("test", 1000)}
    assert len(tiny_train) > 100 and len(tiny_test) > 20
    assert not tiny_train & tiny_test
    # The hash gives the test split about TEST_FRACTION of all problem identities.
    owners = [split_of(f"{i} + {i + 1} = {2 * i + 1}") for i in range(4000)]
    assert abs(owners.count("test") / 4000 - TEST_FRACTION) < 0.03


def test_knobs_change_difficulty():
    for ex in ArithmeticTask(digits=3, steps=3).dataset("train", 200):
        lines, _ = _equations(ex["answer"])
        assert len(lines) == 3
        for i, (left, op, right, _) in enumerate(lines):
            if op in "+-":
                assert 100 <= right <= 999, ex
            elif i == 0 and op == "*" and left <= 9:
                assert 100 <= right <= 999, ex  # "has k boxes with b in each": k * b
            else:
                assert 2 <= right <= 9, ex
        # Every number in the question is either a 3-digit amount or a 1-digit factor.
        numbers = [int(n) for n in re.findall(r"\d+", ex["question"])]
        assert all(100 <= n <= 999 or 2 <= n <= 9 for n in numbers), ex
        assert any(n >= 100 for n in numbers), ex
    for ex in ArithmeticTask(digits=1, steps=1).dataset("test", 200):
        lines, _ = _equations(ex["answer"])
        assert len(lines) == 1
        assert all(2 <= int(n) <= 9 for n in re.findall(r"\d+", ex["question"])), ex
    mean_answer = lambda task: np.mean([int(e["ground_truth"]) for e in task.dataset("train", 300)])
    assert mean_answer(ArithmeticTask(digits=3)) > 5 * mean_answer(ArithmeticTask(digits=2))


def test_prompts_encode_with_the_default_char_tokenizer():
    tok = CharTokenizer()
    unk = tok.token_to_id("<unk>")
    assert unk == 3
    lengths = {}
    for knobs in [(2, 2), (4, 4)]:
        task = ArithmeticTask(*knobs)
        examples = task.dataset("train", 1500) + task.dataset("test", 500)
        ids = [tok.encode_chat(_user(e["question"] + INSTRUCTION_SUFFIX)) for e in examples]
        assert all(unk not in x for x in ids)
        assert all(unk not in tok.encode(e["answer"]) for e in examples)
        assert tok.decode(ids[0]) == examples[0]["question"] + INSTRUCTION_SUFFIX
        lengths[knobs] = np.array([len(x) for x in ids])
    default = lengths[(2, 2)]
    print(
        f"default task prompt length in CharTokenizer tokens: max {default.max()}, "
        f"mean {default.mean():.1f}, p99 {np.percentile(default, 99):.0f}; "
        f"digits=4/steps=4 max {lengths[(4, 4)].max()}"
    )
    assert 40 <= default.mean() <= 80
    assert default.max() <= 128  # one bucket for the default task
    assert lengths[(4, 4)].max() <= 256


def test_task_words_extend_the_default_vocabulary():
    assert TASK_WORDS[: len(DEFAULT_WORDS)] == DEFAULT_WORDS  # default ids unchanged
    tok, big = CharTokenizer(), CharTokenizer(TASK_WORDS)
    assert big.vocab_size <= 256  # fits the embedded tiny model
    examples = ArithmeticTask().dataset("train", 300)
    texts = [e["question"] + INSTRUCTION_SUFFIX for e in examples]
    assert all(big.decode(big.encode(t)) == t for t in texts)
    short = sum(len(big.encode(t)) for t in texts)
    assert short < 0.8 * sum(len(tok.encode(t)) for t in texts)


def test_verl_rows_follow_verl_gsm8k_layout():
    task = ArithmeticTask()
    rows = task.to_verl_rows("test", 3)
    ex = task.example(1, "test")
    assert rows[1] == {
        "data_source": "aqn_jax/arithmetic",
        "prompt": [{"role": "user", "content": ex["question"] + INSTRUCTION_SUFFIX}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ex["ground_truth"]},
        "extra_info": {
            "split": "test",
            "index": 1,
            "answer": ex["answer"],
            "question": ex["question"],
        },
    }
    assert DATA_SOURCE == "aqn_jax/arithmetic"


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def test_parquet_round_trip_and_exact_schema(tmp_path):
    task = ArithmeticTask(seed=5)
    path = task.write_parquet(tmp_path / "sub" / "train.parquet", "train", 40)
    schema = pq.read_schema(path)
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("data_source").type == pa.string()
    assert schema.field("ability").type == pa.string()
    prompt = schema.field("prompt").type
    assert pa.types.is_list(prompt)
    assert sorted(f.name for f in prompt.value_type) == ["content", "role"]
    reward = schema.field("reward_model").type
    assert {f.name: f.type for f in reward} == {"ground_truth": pa.string(), "style": pa.string()}
    extra = schema.field("extra_info").type
    assert {f.name: f.type for f in extra} == {
        "answer": pa.string(),
        "index": pa.int64(),
        "question": pa.string(),
        "split": pa.string(),
    }

    expected = task.dataset("train", 40)
    loaded = load_verl_parquet(path)
    assert loaded == load_examples(path)
    assert [e.index for e in loaded] == list(range(40))
    assert [e.question for e in loaded] == [e["question"] for e in expected]
    assert [e.ground_truth for e in loaded] == [e["ground_truth"] for e in expected]
    assert [e.answer for e in loaded] == [e["answer"] for e in expected]
    assert [e.prompt_messages for e in loaded] == [
        _user(e["question"] + INSTRUCTION_SUFFIX) for e in expected
    ]
    assert {e.data_source for e in loaded} == {"aqn_jax/arithmetic"}


def test_jsonl_round_trip_matches_parquet(tmp_path):
    task = ArithmeticTask(seed=5)
    from_jsonl = load_gsm8k_jsonl(task.write_jsonl(tmp_path / "t.jsonl", "test", 25))
    from_parquet = load_verl_parquet(task.write_parquet(tmp_path / "t.parquet", "test", 25))
    assert [dataclass_fields(e) for e in from_jsonl] == [dataclass_fields(e) for e in from_parquet]
    assert {e.data_source for e in from_jsonl} == {"openai/gsm8k"}
    first = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert first == {k: task.example(0, "test")[k] for k in ("question", "answer")}


def dataclass_fields(e: Example) -> tuple:
    return (e.question, e.prompt_messages, e.ground_truth, e.index, e.answer)


def test_gsm8k_answer_extraction_like_verl(tmp_path):
    assert extract_gsm8k_answer("She pays 2*600 = <<2*600=1200>>1200.\n#### 1,200") == "1200"
    assert extract_gsm8k_answer("#### -3.5") == "-3.5"
    assert extract_gsm8k_answer("no final answer") is None
    records = [
        {"question": "Q one?", "answer": "1 + 1 = 2\n#### 2"},
        {"question": "Q two?", "answer": "It costs $1,234.\n#### 1,234"},
    ]
    path = tmp_path / "gsm8k.json"  # a .json file holding a JSON array
    path.write_text(json.dumps(records))
    loaded = load_examples(path)
    assert [e.ground_truth for e in loaded] == ["2", "1234"]
    assert loaded[1].prompt_messages == _user("Q two?" + INSTRUCTION_SUFFIX)
    jsonl = tmp_path / "gsm8k.jsonl"  # blank lines are skipped
    jsonl.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")
    assert [(e.index, e.ground_truth) for e in load_examples(jsonl)] == [(0, "2"), (1, "1234")]


def _write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_malformed_inputs_raise_actionable_errors(tmp_path):
    good = ArithmeticTask().to_verl_rows("train", 3)

    no_reward = [{k: v for k, v in r.items() if k != "reward_model"} for r in good]
    path = _write_rows(tmp_path / "no_reward.parquet", no_reward)
    with pytest.raises(
        ValueError, match=r"no_reward\.parquet: missing required column.*reward_model"
    ):
        load_verl_parquet(path)

    rows = [dict(r) for r in good]
    rows[1]["reward_model"] = {"style": "rule"}
    path = _write_rows(tmp_path / "no_gt.parquet", rows)
    with pytest.raises(
        ValueError, match=r"no_gt\.parquet: row 1, column 'reward_model\.ground_truth'"
    ):
        load_verl_parquet(path)

    rows = [dict(r) for r in good]
    for r in rows:
        r["reward_model"] = {"style": "rule", "ground_truth": 7}
    path = _write_rows(tmp_path / "int_gt.parquet", rows)
    with pytest.raises(ValueError, match=r"row 0, column 'reward_model\.ground_truth'.*string"):
        load_verl_parquet(path)

    rows = [dict(r) for r in good]
    rows[2]["prompt"] = []
    path = _write_rows(tmp_path / "empty_prompt.parquet", rows)
    with pytest.raises(ValueError, match=r"row 2, column 'prompt'"):
        load_verl_parquet(path)

    path = tmp_path / "text.parquet"
    path.write_text("not parquet\n")
    with pytest.raises(ValueError, match=r"text\.parquet is not a readable parquet file"):
        load_examples(path)

    pq.write_table(pa.Table.from_pylist(good).slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet has no rows"):
        load_examples(tmp_path / "empty.parquet")

    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b", \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1 \(line 2\) is not valid JSON"):
        load_gsm8k_jsonl(path)

    path = tmp_path / "no_hash.jsonl"
    path.write_text('{"question": "a", "answer": "1 + 1 = 2\\nThe answer is 2."}\n')
    with pytest.raises(ValueError, match=r"no_hash\.jsonl: row 0, column 'answer': no '#### "):
        load_gsm8k_jsonl(path)

    path = tmp_path / "no_answer.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"row 1, column 'answer': missing"):
        load_gsm8k_jsonl(path)

    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl is empty"):
        load_examples(path)

    with pytest.raises(ValueError, match=r"unknown dataset extension '\.csv'.*\.parquet"):
        load_examples(tmp_path / "data.csv")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_examples(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------------------------
# PromptBatcher
# ----------------------------------------------------------------------------------------------


def _examples(n: int, seed: int = 0) -> list[Example]:
    task = ArithmeticTask(digits=2, steps=4, seed=seed)  # varied lengths (about 60..200 tokens)
    return [
        Example(e["question"], _user(e["question"] + INSTRUCTION_SUFFIX), e["ground_truth"], i)
        for i, e in enumerate(task.dataset("train", n))
    ]


def test_batches_are_left_padded_to_the_bucket():
    tok = CharTokenizer()
    examples = _examples(40)
    batcher = PromptBatcher(examples, tok, 8, seed=0, max_prompt_len=256)
    assert batcher.buckets == (64, 128, 256)
    widths = set()
    for _ in range(5):
        batch = batcher.next_batch()
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert ids.dtype == np.int32 and mask.dtype == np.int32
        lengths = [len(tok.encode_chat(examples[i].prompt_messages)) for i in batch["index"]]
        width = min(b for b in (64, 128, 256) if b >= max(lengths))
        assert ids.shape == mask.shape == (8, width)
        widths.add(width)
        for row, (i, n) in enumerate(zip(batch["index"], lengths, strict=True)):
            assert mask[row].tolist() == [0] * (width - n) + [1] * n
            assert (ids[row, : width - n] == tok.pad_id).all()
            assert ids[row, width - n :].tolist() == tok.encode_chat(examples[i].prompt_messages)
            assert ids[row, -1] == tok.token_to_id("<|assistant|>")  # generation prompt last
        assert batch["ground_truth"] == [examples[i].ground_truth for i in batch["index"]]
        assert batch["prompt_len"].tolist() == lengths
    assert widths == {128, 256}


def test_buckets_are_capped_and_long_prompts_are_reported():
    tok = CharTokenizer()
    examples = _examples(30)
    lengths = [len(tok.encode_chat(e.prompt_messages)) for e in examples]
    limit = sorted(lengths)[20]
    longest = int(np.argmax(lengths))
    with pytest.raises(ValueError, match=rf"example index {longest} .* {max(lengths)} tokens"):
        PromptBatcher(examples, tok, 4, seed=0, max_prompt_len=max(lengths) - 1)
    batcher = PromptBatcher(examples, tok, 4, seed=0, max_prompt_len=limit, drop_long=True)
    assert batcher.buckets == tuple(sorted({64, limit} if limit > 64 else {limit}))
    assert batcher.dropped_indices == [i for i, n in enumerate(lengths) if n > limit]
    assert batcher.num_dropped == sum(n > limit for n in lengths) > 0
    for _ in range(6):
        assert batcher.next_batch()["input_ids"].shape[1] <= limit
    with pytest.raises(ValueError, match=r"only 3 usable examples .* batch_size = 4"):
        PromptBatcher(examples[:3], tok, 4, seed=0, max_prompt_len=256)


def test_epochs_visit_every_example_once_and_are_deterministic():
    tok = CharTokenizer()
    examples = _examples(50)
    batcher = PromptBatcher(examples, tok, 8, seed=7, max_prompt_len=256)
    assert batcher.batches_per_epoch == 6  # 50 // 8; the last 2 of each epoch are dropped
    batches = [batcher.next_batch() for _ in range(12)]
    assert [b["epoch"] for b in batches] == [0] * 6 + [1] * 6
    assert [b["step"] for b in batches] == list(range(12))
    for epoch in (0, 1):
        seen = [i for b in batches[6 * epoch : 6 * epoch + 6] for i in b["index"]]
        assert len(seen) == len(set(seen)) == 48
        order = np.random.default_rng([7, epoch]).permutation(50)
        assert seen == order[:48].tolist()
        assert set(range(50)) - set(seen) == set(order[48:].tolist())
    epoch0 = [i for b in batches[:6] for i in b["index"]]
    epoch1 = [i for b in batches[6:] for i in b["index"]]
    assert epoch0 != epoch1

    again = PromptBatcher(examples, tok, 8, seed=7, max_prompt_len=256)
    for b in batches:
        nb = again.next_batch()
        assert nb["index"] == b["index"]
        np.testing.assert_array_equal(nb["input_ids"], b["input_ids"])
    other = PromptBatcher(examples, tok, 8, seed=8, max_prompt_len=256)
    assert other.next_batch()["index"] != batches[0]["index"]


@pytest.mark.parametrize("n", [50, 28])  # 28: the 4th batch is the first of epoch 1
def test_resume_continues_exactly(n):
    tok = CharTokenizer()
    examples = _examples(n)
    make = lambda: PromptBatcher(examples, tok, 8, seed=3, max_prompt_len=256)
    uninterrupted = make()
    expected = [uninterrupted.next_batch() for _ in range(5)]

    first = make()
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state()))  # survives a JSON checkpoint
    assert (state["epoch"], state["offset"], state["step"]) == (
        (0, 24, 3) if n == 50 else (1, 0, 3)
    )
    resumed = make().restore(state)
    assert resumed.position == first.position
    for want in expected[3:]:
        got = resumed.next_batch()
        assert (got["index"], got["epoch"], got["step"]) == (
            want["index"],
            want["epoch"],
            want["step"],
        )
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
        np.testing.assert_array_equal(got["attention_mask"], want["attention_mask"])

    with pytest.raises(ValueError, match=r"state has seed = 3 but this batcher has 4"):
        PromptBatcher(examples, tok, 8, seed=4, max_prompt_len=256).load_state(state)
    with pytest.raises(ValueError, match=r"state has fingerprint"):
        PromptBatcher(_examples(n, seed=1), tok, 8, seed=3, max_prompt_len=256).load_state(state)


def test_batcher_uses_the_hf_chat_template():
    """HFTokenizer prompts go through its (Qwen-style ChatML) template; padding uses its pad."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    examples = _examples(6)
    rust.train_from_iterator([e.prompt_messages[0]["content"] for e in examples], trainer)
    rust.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    template = (
        "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\\n' }}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' "
        "+ m.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tok = HFTokenizer(rust, template, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    batch = PromptBatcher(examples, tok, 3, seed=0, max_prompt_len=1024).next_batch()
    row = batch["input_ids"][0]
    text = tok.decode(row[batch["attention_mask"][0] == 1], skip_special_tokens=False)
    question = examples[batch["index"][0]].question
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        f"<|im_end|>\n<|im_start|>user\n{question}{INSTRUCTION_SUFFIX}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert row[0] == tok.pad_id == rust.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("digits, steps", [(1, 1), (2, 2), (3, 4)])
def test_redrawn_numbers_keep_the_words_and_the_split(digits, steps):
    from aqn_jax.data.arithmetic import ArithmeticTask, split_of

    task = ArithmeticTask(digits=digits, steps=steps)
    original, redrawn = task.examples("test", 60), task.redrawn("test", 60)
    assert [e.question for e in task.redrawn("test", 60)] == [e.question for e in redrawn]
    changed = 0
    for a, b in zip(original, redrawn, strict=True):
        # The same words; only the numbers differ, and at least one does.
        assert re.sub(r"\d+", "#", a.question) == re.sub(r"\d+", "#", b.question)
        assert re.findall(r"\d+", a.question) != re.findall(r"\d+", b.question)
        # The worked solution is a valid chain over the new numbers, in the same split.
        lines = b.answer.split("\n")
        value = None
        for line in lines[:-1]:
            x, op, y, _, z = line.split()
            assert value is None or int(x) == value
            assert {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}.get(
                op, int(x) // int(y)
            ) == int(z)
            assert op != "/" or int(x) % int(y) == 0
            value = int(z)
        assert lines[-1] == f"#### {value}" and b.ground_truth == str(value) and value > 0
        assert split_of("\n".join(lines[:-1])) == "test"
        assert b.prompt_messages[0]["content"].startswith(b.question)
        changed += a.ground_truth != b.ground_truth
    assert changed > 30  # most answers change (negative control: not the same problems)
    with pytest.raises(ValueError, match="not a problem of this task"):
        task.redraw_numbers({"question": "Tom has 3 apples.", "answer": "#### 3"}, None)


def test_split_by_question_shares_facts_not_questions():
    from aqn_jax.data.arithmetic import ArithmeticTask, split_of

    task = ArithmeticTask(digits=1, steps=1, split_by="question")
    train, test = task.dataset("train", 1000), task.dataset("test", 400)
    assert not {e["question"] for e in train} & {e["question"] for e in test}
    assert all(split_of(e["question"]) == "test" for e in test)
    chain = lambda e: e["answer"].rsplit("\n", 1)[0]
    # The facts are shared (a chain split shares none: test_train_and_test_splits_are_disjoint).
    shared = {chain(e) for e in train} & {chain(e) for e in test}
    assert len(shared) > 0.5 * len({chain(e) for e in test})
    # Redrawn numbers keep the question split.
    for ex in task.redrawn("test", 50):
        assert split_of(ex.question) == "test"
    with pytest.raises(ValueError, match="split_by = 'words'"):
        ArithmeticTask(split_by="words")


def test_prompt_format_shows_worked_problems_and_the_instruction(tmp_path):
    """config.data.shots / instruction (data.config.with_prompt_format): every prompt starts
    with the first `shots` train problems as earlier chat turns, their solutions without GSM8K's
    calculator annotations and answered in the reward's form, and those problems leave the
    train split; the defaults change nothing (the negative control)."""
    from aqn_jax.data.config import check_data, data_config, load_split, shot_answer
    from aqn_jax.data.gsm8k import Example

    data = data_config()
    data.train_size, data.test_size = 6, 3
    plain = {s: load_split(data, s) for s in ("train", "test")}
    assert plain["test"] == ArithmeticTask(2, 2, 0).examples("test", 3)  # defaults: unchanged

    data.shots, data.reward_method, data.instruction = 2, "boxed", " Be brief."
    train, test = load_split(data, "train"), load_split(data, "test")
    assert [e.index for e in train] == [2, 3, 4, 5]  # the shown problems are not trained on
    shown = plain["train"][:2]
    for ex, before in zip(test, plain["test"], strict=True):
        assert ex.ground_truth == before.ground_truth and ex.question == before.question
        msgs = ex.prompt_messages
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
        assert msgs[-1]["content"] == before.question + " Be brief."
        for k, shot in enumerate(shown):
            assert msgs[2 * k]["content"] == shot.question + " Be brief."
            lines = shot.answer.split("####")[0].strip()  # e.g. "12 + 7 = 19\n19 * 2 = 38"
            assert msgs[2 * k + 1]["content"] == f"{lines}\n\\boxed{{{shot.ground_truth}}}"

    # Only shots: verl's instruction stays; the strict reward's form is '#### N'.
    data.instruction, data.reward_method = "", "strict"
    msgs = load_split(data, "test")[0].prompt_messages
    assert msgs[-1]["content"] == plain["test"][0].question + INSTRUCTION_SUFFIX
    assert msgs[1]["content"].endswith(f"\n#### {shown[0].ground_truth}")

    gsm = Example(
        "q", [], "72", 0, answer="Half: 48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"
    )
    assert shot_answer(gsm, "boxed") == "Half: 48/2 = 24\n48+24 = 72\n\\boxed{72}"

    for value in (-1, 9):  # (ConfigDict itself refuses a float or a string here)
        bad = data_config()
        bad.shots = value
        with pytest.raises(
            ValueError, match=rf"^config\.data\.shots={value}; allowed: an int in 0\.\.8"
        ):
            check_data(bad)
    data.train_size, data.shots = 6, 7
    with pytest.raises(ValueError, match=r"config\.data\.shots=7 but the train split has 6"):
        load_split(data, "test")


def test_prompt_format_is_part_of_the_warm_start_key():
    """An SFT warm start trained on one prompt form is not reused for another; at the defaults
    the key is the one made before config.data.shots / instruction existed (the shipped one)."""
    from aqn_jax.experiment import base_config
    from aqn_jax.spec import warm_start_spec

    config = base_config()
    plain = warm_start_spec(config).key
    config.data.shots = 1
    shots = warm_start_spec(config).key
    config.data.shots, config.data.instruction = 0, " Be brief."
    instruction = warm_start_spec(config).key
    config.data.instruction = ""
    assert warm_start_spec(config).key == plain  # negative control: back to the defaults
    assert len({plain, shots, instruction}) == 3
