"""`config.data`: where prompts come from, validated before anything compiles.

  --config.data.train_path=/data/gsm8k/train.parquet --config.data.test_path=.../test.parquet

Empty paths select the embedded arithmetic task (`config.data.task.*` sets its difficulty), so
the default runs with no download. A path is verl parquet or raw GSM8K jsonl
(`aqn_jax.data.gsm8k.load_examples`).
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from aqn_jax.rewards import METHODS

from .arithmetic import ArithmeticTask
from .gsm8k import Example, load_examples

SPLIT_FIELDS = {"train": "train_path", "test": "test_path"}


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
    if data.get("reward_method", "strict") not in METHODS:
        raise ValueError(
            f"config.data.reward_method={data.reward_method!r}; allowed: {list(METHODS)}"
        )
    if bool(data.train_path) != bool(data.test_path):
        raise ValueError(
            f"config.data.train_path={data.train_path!r}, test_path={data.test_path!r}: give both"
            " (a real dataset) or neither (the embedded arithmetic task)"
        )
    if not data.train_path:
        for field in ("train_size", "test_size"):
            if data[field] < 1:
                raise ValueError(f"config.data.{field}={data[field]}; must be >= 1")
        try:
            task_of(data)
        except ValueError as e:
            raise ValueError(f"config.data.task: {e}") from e


def load_split(data: Any, split: str) -> list[Example]:
    """The examples of `split` ('train' | 'test')."""
    if split not in SPLIT_FIELDS:
        raise ValueError(f"split={split!r}; allowed: {list(SPLIT_FIELDS)}")
    check_data(data)
    path = data[SPLIT_FIELDS[split]]
    if path:
        return load_examples(os.path.expanduser(path))
    return task_of(data).examples(split, int(data[f"{split}_size"]))


def task_of(data: Any) -> ArithmeticTask:
    """The embedded task of `config.data` (its `task` section)."""
    t = data.task
    return ArithmeticTask(int(t.digits), int(t.steps), int(t.seed), str(t.get("split_by", "chain")))
