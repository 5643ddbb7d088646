"""`config.data`: where prompts come from, validated before anything compiles.

  --config.data.train_path=/data/gsm8k/train.parquet --config.data.test_path=.../test.parquet

Empty paths select the embedded arithmetic task (`config.data.task.*` sets its difficulty), so
the default runs with no download. A path is verl parquet or raw GSM8K jsonl
(`aqn_jax.data.gsm8k.load_examples`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import ml_collections

from aqn_jax.rewards import METHODS

from .arithmetic import ArithmeticTask
from .gsm8k import Example, load_examples
from .tokenizers import INSTRUCTION_SUFFIX

SPLIT_FIELDS = {"train": "train_path", "test": "test_path"}
MAX_SHOTS = 8  # few-shot turns (config.data.shots): each adds a problem's tokens to every prompt


def data_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.train_path = ""  # verl parquet / GSM8K jsonl; '' = the embedded arithmetic task
    c.test_path = ""
    c.train_size = 4096  # embedded task: problems generated for the train split
    c.test_size = 256  # embedded task: problems in the test split (validation)
    # Train prompts longer than config.rollout.max_prompt_len: True = drop them (the train job
    # prints how many at the start); False = refuse to start, naming the count.
    c.drop_long_prompts = True
    # How the reward reads an answer (aqn_jax/rewards.py, verl's GSM8K semantics): strict = the
    # number after '#### ' (the trained format) | flexible = the last number in the completion
    # (a pretrained instruct model that answers in prose, e.g. SmolLM2 without SFT) | boxed =
    # the last \boxed{...}, else '#### N', normalised, numbers compared as numbers (Qwen2.5).
    c.reward_method = "strict"
    # The prompt (with_prompt_format): '' = verl's instruction after every question (' Let's
    # think step by step and output the final answer after "####".'); else this text instead.
    c.instruction = ""
    # Worked train problems shown before every question as earlier chat turns (user: question
    # + instruction; assistant: the solution's lines, then the answer in the reward's format);
    # 0 = none. The first `shots` train problems are taken for it and left out of training.
    c.shots = 0
    c.task = ml_collections.ConfigDict()
    c.task.digits = 2  # embedded task difficulty (aqn_jax/data/arithmetic.py)
    c.task.steps = 2
    c.task.seed = 0
    c.task.split_by = "chain"  # a problem's identity for the split: chain | question
    return c


def check_data(data: Any) -> None:
    """Raise naming the field: a missing file, or a half-configured real dataset."""
    for field in SPLIT_FIELDS.values():
        path = data[field]
        if path and not os.path.isfile(os.path.expanduser(path)):
            what = "a directory" if os.path.isdir(os.path.expanduser(path)) else "no such file"
            raise ValueError(
                f"config.data.{field}={path!r}: {what}; expected a file (verl .parquet or GSM8K"
                " .jsonl)"
            )
    METHODS.check(data.get("reward_method", "strict"))
    if bool(data.train_path) != bool(data.test_path):
        raise ValueError(
            f"config.data.train_path={data.train_path!r}, test_path={data.test_path!r}: give both"
            " (a real dataset) or neither (the embedded arithmetic task)"
        )
    instruction = data.get("instruction", "")
    if instruction in (None, "None"):
        raise ValueError(
            f"config.data.instruction={instruction!r} would append the text 'None' to every"
            " question; allowed: '' (verl's instruction) or the instruction's text"
        )
    if not isinstance(instruction, str):
        raise ValueError(f"config.data.instruction={instruction!r}; must be a string")
    shots = data.get("shots", 0)
    if not isinstance(shots, int) or isinstance(shots, bool) or not 0 <= shots <= MAX_SHOTS:
        raise ValueError(f"config.data.shots={shots!r}; allowed: an int in 0..{MAX_SHOTS}")
    if not data.train_path:
        for field in ("train_size", "test_size"):
            if data[field] < 1:
                raise ValueError(f"config.data.{field}={data[field]}; must be >= 1")
        try:
            task_of(data)
        except ValueError as e:
            raise ValueError(f"config.data.task: {e}") from e


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """config.data.task, typed: the embedded arithmetic task's difficulty and split."""

    digits: int
    steps: int
    seed: int
    split_by: str  # chain | question


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """config.data, checked and typed (`DataSpec.of`): where the prompts come from and how they
    are asked."""

    train_path: str  # '' with test_path '': the embedded task
    test_path: str
    train_size: int  # the embedded task's split sizes
    test_size: int
    drop_long_prompts: bool
    reward_method: str  # rewards.METHODS
    instruction: str  # '' = verl's
    shots: int
    task: TaskSpec

    @classmethod
    def of(cls, data: Any) -> DataSpec:
        """`data` (config.data) checked (`check_data`: one line naming the field) and typed; a
        DataSpec is returned as it is."""
        if isinstance(data, DataSpec):
            return data
        check_data(data)
        t = data.task
        return cls(
            train_path=str(data.train_path or ""),
            test_path=str(data.test_path or ""),
            train_size=int(data.train_size),
            test_size=int(data.test_size),
            drop_long_prompts=bool(data.get("drop_long_prompts", True)),
            reward_method=str(data.get("reward_method", "strict")),
            instruction=str(data.get("instruction", "")),
            shots=int(data.get("shots", 0)),
            task=TaskSpec(
                int(t.digits), int(t.steps), int(t.seed), str(t.get("split_by", "chain"))
            ),
        )

    def path(self, split: str) -> str:
        """The file of `split` ('train' | 'test'); '' for the embedded task."""
        return self.train_path if split == "train" else self.test_path

    def size(self, split: str) -> int:
        """The embedded task's problems in `split`."""
        return self.train_size if split == "train" else self.test_size


def load_split(data: Any, split: str) -> list[Example]:
    """The examples of `split` ('train' | 'test') of `data` (a DataSpec, or config.data)."""
    if split not in SPLIT_FIELDS:
        raise ValueError(f"split={split!r}; allowed: {list(SPLIT_FIELDS)}")
    data = DataSpec.of(data)
    return with_prompt_format(_raw_split(data, split), data, split)


def _raw_split(data: DataSpec, split: str) -> list[Example]:
    path = data.path(split)
    if path:
        return load_examples(os.path.expanduser(path))
    return task_of(data).examples(split, data.size(split))


def with_prompt_format(examples: list[Example], data: Any, split: str) -> list[Example]:
    """`examples` as the policy is asked them: `config.data.instruction` after each question
    and `config.data.shots` worked train problems before it, as earlier chat turns (a few-shot
    chat prompt fixes an instruct model's answer format: shown one solved problem, an instruct
    model answers in the reward's form instead of in prose). The defaults return `examples`
    unchanged; the train split loses the problems the shots show."""
    data = DataSpec.of(data)
    instruction, shots = data.instruction, data.shots
    if not instruction and not shots:
        return examples
    suffix = instruction or INSTRUCTION_SUFFIX
    shown = _raw_split(data, "train")[:shots]
    if len(shown) < shots:
        raise ValueError(f"config.data.shots={shots} but the train split has {len(shown)} problems")
    history: list[dict[str, str]] = []
    for ex in shown:
        if not ex.answer:
            raise ValueError(
                f"config.data.shots={shots}: train problem {ex.index} has no worked solution"
                " to show (a GSM8K 'answer' / verl extra_info.answer); use shots=0"
            )
        history += [
            {"role": "user", "content": ex.question + suffix},
            {"role": "assistant", "content": shot_answer(ex, data.reward_method)},
        ]
    keep = examples[shots:] if split == "train" else examples
    return [
        dataclasses.replace(
            ex, prompt_messages=[*history, {"role": "user", "content": ex.question + suffix}]
        )
        for ex in keep
    ]


def shot_answer(ex: Example, reward_method: str) -> str:
    """A shown problem's reply: its worked solution's lines without GSM8K's calculator
    annotations (<<12*3=36>>), then its answer in the form the reward reads."""
    lines = re.sub(r"<<[^>]*>>", "", ex.answer or "").split("####")[0].strip()
    final = METHODS.get(reward_method).shot(ex.ground_truth)
    return f"{lines}\n{final}" if lines else final


def task_of(data: Any) -> ArithmeticTask:
    """The embedded task of `data` (a DataSpec, or config.data: its `task` section)."""
    t = data.task
    split_by = str(getattr(t, "split_by", "chain"))
    return ArithmeticTask(int(t.digits), int(t.steps), int(t.seed), split_by)
