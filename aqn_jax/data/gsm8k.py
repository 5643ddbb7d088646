"""GSM8K loaders (verl parquet, raw jsonl) and the prompt batcher that feeds rollouts.

The real setting reads GSM8K exactly as verl prepares it (examples/data_preprocess/gsm8k.py):
one parquet row per problem with a chat `prompt` (question + the "####" instruction) and
`reward_model.ground_truth`; or the raw `{"question", "answer"}` jsonl, from which the ground
truth is extracted the way verl does. The embedded synthetic task writes the same formats
(`aqn_jax.data.arithmetic`), so both settings go through these loaders.

`PromptBatcher` tokenizes every prompt once, shuffles per (seed, epoch), left-pads each batch to
one of a few fixed lengths (so a jitted sampler compiles once per bucket, not once per batch)
and can be checkpointed and resumed mid-epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqn_jax.data.tokenizers import INSTRUCTION_SUFFIX, Tokenizer

__all__ = [
    "GSM8K_DATA_SOURCE",
    "Example",
    "PromptBatcher",
    "extract_gsm8k_answer",
    "load_examples",
    "load_gsm8k_jsonl",
    "load_verl_parquet",
    "tokenize_prompts",
    "verl_schema",
]

GSM8K_DATA_SOURCE = "openai/gsm8k"

# verl's gsm8k regex (extract_solution in examples/data_preprocess/gsm8k.py).
_GSM8K_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def verl_schema() -> Any:
    """The Arrow schema of verl's GSM8K parquet, for writers that must match it exactly.

    A function, not a constant, so importing this module does not import pyarrow (rollout
    workers that only batch prompts never need it). Nested fields are in the order found in
    parquet files written by verl's preprocessing; readers look fields up by name.
    """
    import pyarrow as pa

    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("answer", pa.string()),
                        ("index", pa.int64()),
                        ("question", pa.string()),
                        ("split", pa.string()),
                    ]
                ),
            ),
        ]
    )


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt of an RL dataset.

    Attributes:
      question: the problem text without the instruction suffix (for logs and SFT).
      prompt_messages: the chat messages given to the policy (verl's `prompt` column).
      ground_truth: the string the strict reward compares the extracted answer with.
      index: 0-based position of the row in its file (= verl's extra_info.index for files
        written by verl's preprocessing); identifies the example in batches and logs.
      answer: the worked solution when the file has one (raw GSM8K `answer`, or verl's
        extra_info.answer), else None; the SFT warm-start trains on it.
      data_source: verl's `data_source` ("openai/gsm8k" for GSM8K); metric names use it.
    """

    question: str
    prompt_messages: list[dict[str, str]]
    ground_truth: str
    index: int
    answer: str | None = None
    data_source: str = GSM8K_DATA_SOURCE


def _question_from_prompt(content: str) -> str:
    """Strip the instruction that verl's preprocessing appended to the question."""
    if content.endswith(INSTRUCTION_SUFFIX):
        return content[: -len(INSTRUCTION_SUFFIX)]
    return content


def extract_gsm8k_answer(answer: str) -> str | None:
    """Ground truth of a GSM8K worked solution: the number after the last "#### ", no commas.

    Same regex as verl's `extract_solution`; verl takes the first match, which is the same for
    GSM8K (one "####" per answer); the last is what a reader means if there were several.
    Returns None when there is no "#### <number>".
    """
    matches = _GSM8K_ANSWER_RE.findall(answer)
    if not matches:
        return None
    return matches[-1].replace(",", "")


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------


def _bad(path: Path, row: int, column: str, problem: str) -> ValueError:
    return ValueError(f"{path}: row {row}, column {column!r}: {problem}")


def _parse_prompt(path: Path, row: int, value: Any) -> list[dict[str, str]]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _bad(
            path,
            row,
            "prompt",
            f"expected a non-empty list of {{'role', 'content'}} messages, got {value!r}",
        )
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise _bad(path, row, "prompt", f"message {j} is not a dict: {message!r}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise _bad(
                path,
                row,
                "prompt",
                f"message {j} needs string 'role' and 'content', got role={role!r}, "
                f"content={content!r}",
            )
        messages.append({"role": role, "content": content})
    return messages


def _parse_ground_truth(path: Path, row: int, value: Any) -> str:
    if not isinstance(value, Mapping):
        raise _bad(
            path,
            row,
            "reward_model",
            f"expected a dict with 'ground_truth' (and 'style'), got {value!r}",
        )
    if value.get("ground_truth") is None:
        raise _bad(
            path,
            row,
            "reward_model.ground_truth",
            f"missing; expected the final answer as a string, e.g. '72' (got {dict(value)!r})",
        )
    gt = value["ground_truth"]
    if not isinstance(gt, str):
        # verl's reward compares strings; a numeric ground truth would never match (72 != "72").
        raise _bad(
            path,
            row,
            "reward_model.ground_truth",
            f"expected a string, got {type(gt).__name__} {gt!r}; store it as a string "
            f"(e.g. {str(gt)!r}) because the reward compares strings",
        )
    return gt


def load_verl_parquet(path: str | os.PathLike[str]) -> list[Example]:
    """Read a verl RL parquet (e.g. verl's gsm8k train.parquet / test.parquet).

    Required columns: `prompt` (list of {role, content}) and `reward_model` (with a string
    `ground_truth`). Optional: `data_source`, `extra_info` (its `question` and `answer` are
    used when present; otherwise the question is the last user message minus the
    instruction suffix). Raises ValueError naming the file, row and column of a bad value.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"dataset file {str(file)!r} does not exist")
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{file} is not a readable parquet file: {e}") from e
    missing = [c for c in ("prompt", "reward_model") if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{file}: missing required column(s) {missing}; verl's RL parquet has columns "
            f"data_source, prompt, ability, reward_model, extra_info (found {table.column_names})"
        )
    if table.num_rows == 0:
        raise ValueError(f"{file} has no rows; expected at least one example")

    examples = []
    for row, record in enumerate(table.to_pylist()):
        messages = _parse_prompt(file, row, record["prompt"])
        gt = _parse_ground_truth(file, row, record["reward_model"])
        extra = record.get("extra_info")
        if extra is not None and not isinstance(extra, Mapping):
            raise _bad(file, row, "extra_info", f"expected a dict or null, got {extra!r}")
        extra = extra or {}
        question = extra.get("question")
        if question is None:
            users = [m["content"] for m in messages if m["role"] == "user"]
            question = _question_from_prompt(users[-1] if users else messages[-1]["content"])
        elif not isinstance(question, str):
            raise _bad(file, row, "extra_info.question", f"expected a string, got {question!r}")
        answer = extra.get("answer")
        if answer is not None and not isinstance(answer, str):
            raise _bad(file, row, "extra_info.answer", f"expected a string, got {answer!r}")
        source = record.get("data_source")
        if source is not None and not isinstance(source, str):
            raise _bad(file, row, "data_source", f"expected a string, got {source!r}")
        examples.append(
            Example(
                question=question,
                prompt_messages=messages,
                ground_truth=gt,
                index=row,
                answer=answer,
                data_source=source or GSM8K_DATA_SOURCE,
            )
        )
    return examples


def _gsm8k_example(file: Path, row: int, record: Any) -> Example:
    if not isinstance(record, Mapping):
        raise _bad(
            file,
            row,
            "question",
            f"expected a JSON object with 'question' and 'answer', got {record!r}",
        )
    for column in ("question", "answer"):
        if column not in record:
            raise _bad(file, row, column, f"missing (keys present: {sorted(record)})")
        if not isinstance(record[column], str):
            raise _bad(file, row, column, f"expected a string, got {record[column]!r}")
    gt = extract_gsm8k_answer(record["answer"])
    if gt is None:
        tail = record["answer"][-80:]
        raise _bad(
            file,
            row,
            "answer",
            f"no '#### <number>' final answer (GSM8K answers end with e.g. '#### 72'); "
            f"the answer ends with {tail!r}",
        )
    question = record["question"]
    return Example(
        question=question,
        prompt_messages=[{"role": "user", "content": question + INSTRUCTION_SUFFIX}],
        ground_truth=gt,
        index=row,
        answer=record["answer"],
    )


def load_gsm8k_jsonl(path: str | os.PathLike[str]) -> list[Example]:
    """Read raw GSM8K: one {"question", "answer"} JSON object per line (blank lines skipped).

    A `.json` file holding one JSON array of such objects is read too. The prompt is
    question + INSTRUCTION_SUFFIX as one user message, as verl's preprocessing builds it; the
    ground truth is verl's: the number after "#### " with "," removed. Rows are numbered from 0
    over the records (errors also give the 1-based line number).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"dataset file {str(file)!r} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text (is it a parquet file?): {e}") from e
    if not text.strip():
        raise ValueError(f"{file} is empty; expected one {{'question', 'answer'}} object a line")

    if file.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        if not records:
            raise ValueError(f"{file} holds an empty list; expected at least one example")
        return [_gsm8k_example(file, row, r) for row, r in enumerate(records)]

    examples = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = len(examples)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{file}: row {row} (line {line_no}) is not valid JSON ({e}); expected one "
                f"{{'question', 'answer'}} object a line, got {line[:80]!r}"
            ) from e
        try:
            examples.append(_gsm8k_example(file, row, record))
        except ValueError as e:
            raise ValueError(f"{e} (line {line_no})") from None
    return examples


def load_examples(path: str | os.PathLike[str]) -> list[Example]:
    """Load a dataset by extension: .parquet (verl) or .jsonl / .json (raw GSM8K)."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return load_verl_parquet(file)
    if suffix in (".jsonl", ".json"):
        return load_gsm8k_jsonl(file)
    raise ValueError(
        f"{file}: unknown dataset extension {file.suffix!r}; expected .parquet (verl's RL "
        "format) or .jsonl / .json (raw GSM8K {'question', 'answer'} records)"
    )


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


def tokenize_prompts(examples: Sequence[Example], tokenizer: Tokenizer) -> list[list[int]]:
    """Every example's prompt as the policy sees it: its chat template with the generation
    prompt appended, tokenized (what `PromptBatcher` pads and what its length limit counts)."""
    texts = [tokenizer.apply_chat_template(ex.prompt_messages) for ex in examples]
    return tokenizer.encode_batch(texts)  # == encode_chat per example, batched for HF


_STATE_VERSION = 1


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Token rows LEFT-padded with `pad_id` to `width` (default: the longest row), as
    generation needs them (it appends on the right): ids, mask [len(rows), width] int32."""
    width = max(len(r) for r in rows) if width is None else int(width)
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def _check_batcher_args(examples, batch_size, seed, max_prompt_len, buckets) -> None:
    """`PromptBatcher`'s arguments: integers in range, a non-empty dataset."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise ValueError(f"batch_size must be an integer, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size} must be >= 1")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed = {seed!r} must be a non-negative integer")
    if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, (int, np.integer)):
        raise ValueError(f"max_prompt_len must be an integer, got {max_prompt_len!r}")
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len = {max_prompt_len} must be >= 1")
    bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, (int, np.integer))]
    if not buckets or bad or min(buckets) < 1:
        raise ValueError(f"buckets must be a non-empty list of positive ints, got {buckets!r}")
    if not examples:
        raise ValueError("examples is empty; load a dataset with at least one example")


class PromptBatcher:
    """Endless, shuffled, resumable batches of left-padded prompt token ids.

    Order: epoch e visits the examples in `np.random.default_rng([seed, e]).permutation(n)`,
    cut into `n // batch_size` batches; the incomplete final batch of an epoch is dropped
    (drop-last: its `n % batch_size` examples are skipped in that epoch only - the next epoch's
    permutation differs), so every batch has exactly `batch_size` prompts and the sampler sees
    one batch shape per bucket. Epochs advance automatically.

    Padding: prompts are LEFT-padded with `tokenizer.pad_id` (generation appends on the right)
    to the smallest bucket >= the longest prompt in the batch. Buckets larger than
    `max_prompt_len` are replaced by `max_prompt_len` itself, so a batch is never wider than
    the configured prompt length.

    Resume: `state()` is a JSON-serialisable dict (epoch, offset, step, plus a fingerprint of
    the tokenized dataset); a batcher built with the same arguments and `load_state(state)`
    (or `restore(state)`) continues with exactly the batch the saved one would have produced.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        tokenizer: Tokenizer,
        batch_size: int,
        seed: int,
        *,
        max_prompt_len: int,
        buckets: Sequence[int] = (64, 128, 256, 512, 1024),
        drop_long: bool = False,
    ) -> None:
        """Tokenize every prompt once through the chat template.

        Args:
          examples: the dataset (e.g. from `load_examples`).
          tokenizer: renders `prompt_messages` with its chat template (CharTokenizer's own, or
            the HF snapshot's - Qwen's for Qwen2.5) with the generation prompt appended.
          batch_size: prompts per batch (drop-last; see the class docstring).
          seed: shuffling seed; the order of epoch e depends only on (seed, e).
          max_prompt_len: longest prompt allowed, in tokens.
          buckets: padded lengths; a few fixed values so a jitted sampler compiles few shapes.
          drop_long: drop prompts longer than `max_prompt_len` (counted in `num_dropped`,
            listed in `dropped_indices`) instead of raising.
        """
        _check_batcher_args(examples, batch_size, seed, max_prompt_len, buckets)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.max_prompt_len = int(max_prompt_len)
        self.buckets: tuple[int, ...] = tuple(
            sorted({int(b) for b in buckets if b < max_prompt_len} | {self.max_prompt_len})
        )
        self.pad_id = int(tokenizer.pad_id)

        all_ids = tokenize_prompts(examples, tokenizer)
        kept: list[Example] = []
        ids: list[np.ndarray] = []
        self.dropped_indices: list[int] = []
        for pos, (ex, tok) in enumerate(zip(examples, all_ids, strict=True)):
            if len(tok) > self.max_prompt_len:
                if drop_long:
                    self.dropped_indices.append(ex.index)
                    continue
                raise ValueError(
                    f"example index {ex.index} (position {pos}) has a prompt of {len(tok)} "
                    f"tokens > max_prompt_len = {self.max_prompt_len}; raise max_prompt_len or "
                    "pass drop_long=True to skip such prompts"
                )
            if len(tok) == 0:
                raise ValueError(f"example index {ex.index} (position {pos}) has an empty prompt")
            kept.append(ex)
            ids.append(np.asarray(tok, dtype=np.int32))
        if len(kept) < self.batch_size:
            fix = "raise max_prompt_len, " if self.dropped_indices else ""
            raise ValueError(
                f"only {len(kept)} usable examples ({len(self.dropped_indices)} dropped as longer "
                f"than max_prompt_len = {self.max_prompt_len}) for batch_size = "
                f"{self.batch_size}; {fix}lower batch_size or use more examples"
            )
        self.examples: list[Example] = kept
        self._ids = ids
        self.lengths = np.array([len(t) for t in ids], dtype=np.int32)
        self._fingerprint = self._compute_fingerprint()

        self._epoch = 0
        self._offset = 0  # examples of the current epoch's permutation already served
        self._step = 0  # batches served in total
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    # -- bookkeeping -----------------------------------------------------------------------------

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    @property
    def num_dropped(self) -> int:
        """Prompts dropped for exceeding `max_prompt_len` (only with drop_long=True)."""
        return len(self.dropped_indices)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, offset): the next batch starts at `offset` in epoch `epoch`'s permutation."""
        return self._epoch, self._offset

    @property
    def step(self) -> int:
        """Number of batches served so far (the `step` of the next batch)."""
        return self._step

    def _compute_fingerprint(self) -> str:
        # Guards load_state against a different dataset, filter or tokenizer, any of which would
        # silently change the order a resumed run sees.
        h = hashlib.blake2b(digest_size=16)
        for ex, tok in zip(self.examples, self._ids, strict=True):
            h.update(np.int64(ex.index).tobytes())
            h.update(tok.tobytes())
            h.update(ex.ground_truth.encode("utf-8") + b"\0")
        return h.hexdigest()

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position; pass to `load_state` of an identically built batcher."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "offset": self._offset,
            "step": self._step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": self.num_examples,
            "fingerprint": self._fingerprint,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `state()` of a batcher built from the same data and arguments."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"not a PromptBatcher state (version {_STATE_VERSION} expected, got {got!r})"
            )
        expected = {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": self.num_examples,
            "fingerprint": self._fingerprint,
        }
        for key, mine in expected.items():
            if state.get(key) != mine:
                raise ValueError(
                    f"PromptBatcher state has {key} = {state.get(key)!r} but this batcher has "
                    f"{mine!r}; build the batcher from the same dataset, tokenizer, "
                    "max_prompt_len/drop_long, seed and batch_size as the saved run"
                )
        epoch, offset, step = state.get("epoch"), state.get("offset"), state.get("step")
        ok = all(isinstance(v, int) and v >= 0 for v in (epoch, offset, step))
        if not ok or offset % self.batch_size or offset + self.batch_size > self.num_examples:
            raise ValueError(
                f"PromptBatcher state has an invalid position epoch={epoch!r}, "
                f"offset={offset!r}, step={step!r} for {self.num_examples} examples in batches "
                f"of {self.batch_size}"
            )
        self._epoch, self._offset, self._step = epoch, offset, step

    def restore(self, state: Mapping[str, Any]) -> PromptBatcher:
        """`load_state(state)`, returning self (for `PromptBatcher(...).restore(state)`)."""
        self.load_state(state)
        return self

    # -- batches ---------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Positions in `examples` in the order epoch `epoch` visits them (before drop-last)."""
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._perm_epoch = epoch
        return self._perm

    def bucket_for(self, length: int) -> int:
        """Smallest bucket >= length."""
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(f"length {length} exceeds the largest bucket {self.buckets[-1]}")

    def next_batch(self) -> dict[str, Any]:
        """The next batch: input_ids / attention_mask [B, L] int32 (left-padded), ground_truth
        list[str], index list[int] (Example.index), data_source list[str], prompt_len [B]
        int32, epoch and step (of this batch)."""
        picks = self.epoch_order(self._epoch)[self._offset : self._offset + self.batch_size]
        lengths = self.lengths[picks]
        width = self.bucket_for(int(lengths.max()))
        input_ids, attention_mask = left_pad([self._ids[p] for p in picks], self.pad_id, width)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "prompt_len": lengths.copy(),
            "ground_truth": [self.examples[p].ground_truth for p in picks],
            "index": [self.examples[p].index for p in picks],
            "data_source": [self.examples[p].data_source for p in picks],
            "epoch": self._epoch,
            "step": self._step,
        }
        self._offset += self.batch_size
        self._step += 1
        if self._offset + self.batch_size > self.num_examples:  # drop-last: on to the next epoch
            self._epoch += 1
            self._offset = 0
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.next_batch()

    def __repr__(self) -> str:
        return (
            f"PromptBatcher({self.num_examples} examples, batch_size={self.batch_size}, "
            f"seed={self.seed}, buckets={self.buckets}, position={self.position}, "
            f"step={self._step}, dropped={self.num_dropped})"
        )
