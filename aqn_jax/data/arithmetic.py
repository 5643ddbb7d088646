"""The embedded synthetic task: GSM8K-format arithmetic word problems, generated on demand.

Why a synthetic task: the embedded default (no paths given) must train and evaluate without any
download, with a tiny model and `CharTokenizer`, yet exercise exactly the code path of the real
setting (GSM8K in verl's parquet format, strict `#### N` reward). So the problems look like
GSM8K - short stories with names and objects, a worked solution with one equation per line and a
final line `#### N` - and `to_verl_rows` / `write_parquet` emit verl's schema byte for byte, so
`aqn_jax.data.gsm8k.load_verl_parquet` reads them like the real data.

    >>> task = ArithmeticTask(digits=2, steps=2, seed=0)
    >>> ex = task.example(0, "train")
    >>> sorted(ex)
    ['answer', 'ground_truth', 'question']

A problem is a chain of `steps` integer operations (+, -, * and exact /), every intermediate
value a positive integer; the worked solution writes one line per operation, e.g.
"12 + 7 = 19", then "#### 19". Only ASCII is used ("*" and "/", as in GSM8K's calculator
annotations), because `CharTokenizer` maps anything else to `<unk>`.

Difficulty knobs: `digits` is the number of digits of every added/subtracted amount, of the
starting amount and of the per-container count (multipliers and divisors are always 2..9, as in
GSM8K where one factor is usually small); `steps` is the number of operations (solution lines).

Train/test separation: a problem's identity is its chain of equations (the worked solution),
which is a function of the question text, so two problems that differ only in names or objects
count as the same problem. Each identity is assigned to one split by a stable hash
(`split_of`), and `example` resamples until it draws a problem of the requested split. Hence no
question - nor any arithmetic chain - ever appears in both splits, whatever the seed or knobs.

`split_by="question"` makes the question text the identity instead: no question appears in both
splits, but an arithmetic fact does ("7 + 5 = 12" about Tom's apples in train, about Mia's
coins in test), as GSM8K's test problems are new stories over known arithmetic. With one
one-digit operation there are under 200 chains: a chain split asks the model to infer facts it
never saw, a question split asks it to read the story's numbers and operation and answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from aqn_jax.data.tokenizers import DEFAULT_WORDS, INSTRUCTION_SUFFIX

__all__ = [
    "DATA_SOURCE",
    "SPLITS",
    "TASK_WORDS",
    "TEST_FRACTION",
    "ArithmeticTask",
    "split_of",
]

# verl's GSM8K preprocessing writes data_source="openai/gsm8k"; the reward function and the
# metric names (val-core/<data_source>/acc/mean@1) key on it, so the synthetic task has its own.
DATA_SOURCE = "aqn_jax/arithmetic"

SPLITS: dict[str, int] = {"train": 0, "test": 1}
SPLIT_BY = ("chain", "question")

# Share of problem identities owned by the test split (GSM8K: 1319 / 8792 = 15%).
TEST_FRACTION = 0.2

# Resampling budget of `example`; with TEST_FRACTION = 0.2 a test example needs 5 draws on
# average, so hitting this means the knobs leave (almost) no problem in the split - a bug.
_MAX_DRAWS = 10_000

# (name, subject pronoun)
_PEOPLE: tuple[tuple[str, str], ...] = (
    ("Tom", "he"),
    ("Ann", "she"),
    ("Sam", "he"),
    ("Mia", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Max", "he"),
    ("Emma", "she"),
    ("Leo", "he"),
    ("Zoe", "she"),
    ("Jack", "he"),
    ("Lucy", "she"),
)

# (plural, edible): all plurals are single tokens of the default CharTokenizer.
_OBJECTS: tuple[tuple[str, bool], ...] = (
    ("apples", True),
    ("oranges", True),
    ("bananas", True),
    ("books", False),
    ("pencils", False),
    ("marbles", False),
    ("cookies", True),
    ("candies", True),
    ("stickers", False),
    ("cards", False),
    ("toys", False),
    ("flowers", False),
    ("eggs", True),
    ("coins", False),
)

# (plural, singular)
_CONTAINERS: tuple[tuple[str, str], ...] = (
    ("boxes", "box"),
    ("bags", "bag"),
    ("baskets", "basket"),
    ("jars", "jar"),
)

# Verb phrases; fields: {n} amount or factor, {obj} object plural, {friend} another person,
# {subj} the owner's pronoun, {name} the owner, {cont}/{conts} container singular/plural.
_ADD = (
    "buys {n} more {obj}",
    "finds {n} more {obj}",
    "gets {n} more {obj} from {friend}",
    "is given {n} more {obj}",
)
_SUB = (
    "gives away {n} {obj}",
    "gives {n} {obj} to {friend}",
    "loses {n} {obj}",
    "sells {n} {obj}",
)
_SUB_EDIBLE = ("eats {n} {obj}",)
_MUL = (
    "ends up with {n} times as many {obj} as before",
    "gets more {obj} until {subj} has {n} times as many as before",
)
_DIV = (
    "splits the {obj} equally into {n} {conts} and keeps one {cont}",
    "shares the {obj} equally among {n} people and keeps one share",
)
_QUESTIONS = (
    "How many {obj} does {subj} have now?",
    "How many {obj} does {name} have now?",
    "How many {obj} does {subj} have in the end?",
)

# Multi-character strings of the templates that DEFAULT_WORDS lacks. Pass
# `CharTokenizer(words=TASK_WORDS)` to make them single tokens (shorter sequences for the tiny
# model); the default `CharTokenizer()` encodes every problem as well, just in more tokens.
# DEFAULT_WORDS comes first so the ids of a default-tokenizer run stay valid.
TASK_WORDS: tuple[str, ...] = (
    *DEFAULT_WORDS,
    " Tom",
    " Ann",
    " Sam",
    " Mia",
    " Ben",
    " Lily",
    " Max",
    " Emma",
    " Leo",
    " Zoe",
    " Jack",
    " Lucy",
    " baskets",
    " jars",
    " as many",
    " as before",
    " people",
    " share",
    " splits",
    " keeps one",
    " into",
    " until",
    " ends up",
    " given",
    " gives away",
    " him",
    " have now?",
    " in the end?",
    " left?",
    " in total?",
    " does each friend get?",
)


def split_of(identity: str) -> str:
    """The split ("train" or "test") that owns a problem identity, by a stable hash.

    blake2b rather than `hash()`: Python salts str hashes per process, and the assignment must
    be identical across runs, machines and library versions.
    """
    digest = hashlib.blake2b(identity.encode("utf-8"), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2.0**64
    return "test" if u < TEST_FRACTION else "train"


def _check_int(name: str, value: Any, lo: int, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        expected = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} = {value} is out of range; expected an integer {expected}")
    return value


def _check_split(split: Any) -> int:
    if split not in SPLITS:
        raise ValueError(
            f"split = {split!r} is not a split of the arithmetic task; use one of {sorted(SPLITS)}"
        )
    return SPLITS[split]


def _redraw_chain(ops, opening: bool, lo: int, hi: int, digits: int, rng) -> list | None:
    """New (a, b, a op b) for each operation, under `_draw`'s constraints; None if a draw
    leaves an operation infeasible (the caller draws again)."""
    # An opening "k containers with b each" starts from k in 2..9, else from an amount.
    q = int(rng.integers(2, 10)) if opening else int(rng.integers(lo, hi + 1))
    chain = []
    for i, op in enumerate(ops):
        if op == "+":
            n = int(rng.integers(lo, hi + 1))
        elif op == "-":
            if q - 1 < lo:
                return None
            n = int(rng.integers(lo, min(hi, q - 1) + 1))
        elif op == "*":
            if i == 0 and opening:
                n = int(rng.integers(lo, hi + 1))
            elif q >= 10**digits:
                return None
            else:
                n = int(rng.integers(2, 10))
        else:
            divisors = [k for k in range(2, 10) if q % k == 0]
            if not divisors:
                return None
            n = divisors[int(rng.integers(len(divisors)))]
        r = {"+": q + n, "-": q - n, "*": q * n, "/": q // n if op == "/" else 0}[op]
        chain.append((q, n, r))
        q = r
    return chain


def _operation(rng, op: str, q: int, lo: int, hi: int, edible: bool, divisors, equations):
    """Draw operation `op`'s operand and sentence template on the running value `q`; its equation
    appended to `equations`; (operand, template, new value)."""
    if op == "add":
        n = int(rng.integers(lo, hi + 1))
        template = _ADD[int(rng.integers(len(_ADD)))]
        equations.append(f"{q} + {n} = {q + n}")
        q += n
    elif op == "sub":
        n = int(rng.integers(lo, min(hi, q - 1) + 1))
        pool = _SUB + _SUB_EDIBLE if edible else _SUB
        template = pool[int(rng.integers(len(pool)))]
        equations.append(f"{q} - {n} = {q - n}")
        q -= n
    elif op == "mul":
        n = int(rng.integers(2, 10))
        template = _MUL[int(rng.integers(len(_MUL)))]
        equations.append(f"{q} * {n} = {q * n}")
        q *= n
    else:
        n = divisors[int(rng.integers(len(divisors)))]
        template = _DIV[int(rng.integers(len(_DIV)))]
        equations.append(f"{q} / {n} = {q // n}")
        q //= n
    return n, template, q


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Deterministic GSM8K-format word problems: `example(index, split)` is a pure function.

    Attributes:
      digits: digits of every added/subtracted amount, starting amount and per-container count
        (1..4); multipliers and divisors are 2..9 whatever `digits` is.
      steps: operations per problem = lines of the worked solution before "#### N" (1..4).
      seed: selects a different (but equally distributed) stream of problems; the train/test
        assignment of a problem does not depend on it (see the module docstring).
      split_by: a problem's identity for the split: "chain" (its equations) or "question"
        (its text; see the module docstring).
    """

    digits: int = 2
    steps: int = 2
    seed: int = 0
    split_by: str = "chain"

    def __post_init__(self) -> None:
        _check_int("ArithmeticTask.digits", self.digits, 1, 4)
        _check_int("ArithmeticTask.steps", self.steps, 1, 4)
        _check_int("ArithmeticTask.seed", self.seed, 0, None)
        if self.split_by not in SPLIT_BY:
            raise ValueError(f"ArithmeticTask.split_by = {self.split_by!r}; allowed: {SPLIT_BY}")

    def split_of_problem(self, question: str, equations: list[str]) -> str:
        """The split that owns a problem (module docstring: its identity per `split_by`)."""
        return split_of("\n".join(equations) if self.split_by == "chain" else question)

    # -- one problem -----------------------------------------------------------------------------

    def _amount_range(self) -> tuple[int, int]:
        # At least 2 so "1 more apples" never appears; for digits >= 2 this is 10**(digits - 1).
        return max(2, 10 ** (self.digits - 1)), 10**self.digits - 1

    def _draw(self, rng: np.random.Generator) -> tuple[str, list[str], int]:
        """Draw one problem: (question, equation lines, final value)."""
        lo, hi = self._amount_range()
        p = int(rng.integers(len(_PEOPLE)))
        name, subj = _PEOPLE[p]
        friend = _PEOPLE[(p + 1 + int(rng.integers(len(_PEOPLE) - 1))) % len(_PEOPLE)][0]
        obj, edible = _OBJECTS[int(rng.integers(len(_OBJECTS)))]
        conts, cont = _CONTAINERS[int(rng.integers(len(_CONTAINERS)))]
        fields = dict(obj=obj, friend=friend, subj=subj, conts=conts, cont=cont, name=name)

        sentences: list[str] = []
        equations: list[str] = []
        n_ops = self.steps
        opening: str | None
        if rng.random() < 1 / 3:
            # "Tom has 3 boxes with 12 apples in each.": the start is itself the first operation.
            k, b = int(rng.integers(2, 10)), int(rng.integers(lo, hi + 1))
            q = k * b
            sentences.append(f"{name} has {k} {conts} with {b} {obj} in each.")
            equations.append(f"{k} * {b} = {q}")
            n_ops -= 1
            opening = None
        else:
            q = int(rng.integers(lo, hi + 1))
            opening = f"{name} has {q} {obj}"

        question: str | None = None
        last_op = "mul" if opening is None else "none"
        for i in range(n_ops):
            last = i == n_ops - 1
            divisors = [k for k in range(2, 10) if q % k == 0]
            feasible = ["add"]
            if q - 1 >= lo:
                feasible.append("sub")
            if q < 10**self.digits:
                feasible.append("mul")
            if divisors:
                feasible.append("div")
            op = feasible[int(rng.integers(len(feasible)))]
            n, template, q = _operation(rng, op, q, lo, hi, edible, divisors, equations)
            phrase = template.format(n=n, **fields)
            if op == "div" and last and rng.random() < 0.5:
                # GSM8K's classic ending: the division is the question itself.
                phrase = f"shares the {obj} equally among {n} friends"
                question = f"How many {obj} does each friend get?"
            if opening is not None:
                if op in ("add", "sub") and question is None and rng.random() < 0.5:
                    sentences.append(f"{opening} and {phrase}.")  # "Tom has 12 apples and ..."
                    opening = None
                    last_op = op
                    continue
                sentences.append(f"{opening}.")
                opening = None
            start = subj.capitalize() if rng.random() < 0.5 else f"Then {subj}"
            sentences.append(f"{start} {phrase}.")
            last_op = op

        if question is None:
            pool = _QUESTIONS
            if last_op == "sub":
                pool = (*pool, "How many {obj} does {subj} have left?")
            if n_ops == 0:
                pool = ("How many {obj} does {subj} have in total?",)
            question = pool[int(rng.integers(len(pool)))].format(**fields)
        return " ".join([*sentences, question]), equations, q

    def example(self, index: int, split: str) -> dict[str, str]:
        """Problem `index` of `split`: {"question", "answer", "ground_truth"}.

        `answer` is the GSM8K-style worked solution (equation lines, then "#### N") and
        `ground_truth` the string "N" that verl's strict reward compares against. Deterministic
        in (seed, split, index, digits, steps): drawn from `np.random.default_rng([seed,
        split_id, index])`, redrawing from the same stream while the problem belongs to the
        other split.
        """
        split_id = _check_split(split)
        index = _check_int("index", index, 0, None)
        rng = np.random.default_rng([self.seed, split_id, index])
        for _ in range(_MAX_DRAWS):
            question, equations, value = self._draw(rng)
            if self.split_of_problem(question, equations) == split:
                return {
                    "question": question,
                    "answer": "\n".join([*equations, f"#### {value}"]),
                    "ground_truth": str(value),
                }
        raise RuntimeError(  # pragma: no cover - only reachable if the knobs leave no problems
            f"no {split} problem found in {_MAX_DRAWS} draws for {self}; the split assignment "
            "leaves no problem of this difficulty in that split"
        )

    # -- the prompt-dependence control ---------------------------------------------------------

    def redraw_numbers(self, problem: dict[str, str], rng: np.random.Generator) -> dict[str, str]:
        """`problem` (from `example`) with new numbers in the same words: the same names,
        objects, templates and operations, every number drawn again under the generator's
        constraints, the worked solution and answer recomputed. The new problem stays in the
        same split (its identity is redrawn until it does) and differs in at least one number.

        The control of a policy that reads its prompt: its accuracy on redrawn problems stays
        about the same, while a policy that answers from the wording alone collapses.
        The numbers of a question are, in order, the first operand of the first equation then
        the second operand of every equation ("Tom has 3 boxes with 12 apples in each" is the
        equation "3 * 12 = 36")."""
        lines = problem["answer"].split("\n")[:-1]
        eqs = [re.fullmatch(r"(\d+) ([-+*/]) (\d+) = (\d+)", line) for line in lines]
        numbers = [int(m.group(1)) for m in eqs[:1]] + [int(m.group(3)) for m in eqs]
        spans = [m.span() for m in re.finditer(r"\d+", problem["question"])]
        found = [int(problem["question"][a:b]) for a, b in spans]
        if None in eqs or found != numbers:
            raise ValueError(f"not a problem of this task: {problem['question']!r}")
        ops = [m.group(2) for m in eqs]
        opening = re.search(r"has \d+ \w+ with \d+ ", problem["question"]) is not None
        split = self.split_of_problem(problem["question"], lines)
        lo, hi = self._amount_range()
        for _ in range(_MAX_DRAWS):
            chain = _redraw_chain(ops, opening, lo, hi, self.digits, rng)
            if chain is None:
                continue
            new_eqs = [f"{a} {op} {b} = {c}" for (a, b, c), op in zip(chain, ops, strict=True)]
            new = [chain[0][0]] + [b for _, b, _ in chain]
            question = problem["question"]
            for (a, b), value in reversed(list(zip(spans, new, strict=True))):
                question = question[:a] + str(value) + question[b:]
            if new == numbers or self.split_of_problem(question, new_eqs) != split:
                continue
            value = chain[-1][2]
            return {
                "question": question,
                "answer": "\n".join([*new_eqs, f"#### {value}"]),
                "ground_truth": str(value),
            }
        raise RuntimeError(f"no redraw of {problem['question']!r} in {_MAX_DRAWS} draws")

    def redrawn(self, split: str, size: int, seed: int = 1) -> list[Any]:
        """`examples(split, size)` with every problem's numbers redrawn (`redraw_numbers`)."""

        rng = np.random.default_rng([self.seed, _check_split(split), seed, 7])
        out = []
        for ex in self.examples(split, size):
            new = self.redraw_numbers(
                {"question": ex.question, "answer": ex.answer, "ground_truth": ex.ground_truth},
                rng,
            )
            out.append(
                dataclasses.replace(
                    ex,
                    question=new["question"],
                    prompt_messages=[
                        {"role": "user", "content": new["question"] + INSTRUCTION_SUFFIX}
                    ],
                    ground_truth=new["ground_truth"],
                    answer=new["answer"],
                )
            )
        return out

    # -- datasets --------------------------------------------------------------------------------

    def dataset(self, split: str, size: int) -> list[dict[str, str]]:
        """Problems 0..size-1 of `split` (see `example`)."""
        _check_split(split)
        size = _check_int("size", size, 0, None)
        return [self.example(i, split) for i in range(size)]

    def examples(self, split: str, size: int) -> list[Any]:
        """Problems 0..size-1 of `split` as `aqn_jax.data.gsm8k.Example`s, exactly what
        `load_verl_parquet` returns for the file `write_parquet(path, split, size)` writes."""
        from aqn_jax.data.gsm8k import Example

        return [
            Example(
                question=ex["question"],
                prompt_messages=[{"role": "user", "content": ex["question"] + INSTRUCTION_SUFFIX}],
                ground_truth=ex["ground_truth"],
                index=i,
                answer=ex["answer"],
                data_source=DATA_SOURCE,
            )
            for i, ex in enumerate(self.dataset(split, size))
        ]

    def to_verl_rows(self, split: str, size: int) -> list[dict[str, Any]]:
        """Rows in verl's RL parquet schema (as verl's examples/data_preprocess/gsm8k.py writes).

        `data_source` is "aqn_jax/arithmetic" (verl uses "openai/gsm8k" for GSM8K); the prompt
        is one user message, question + INSTRUCTION_SUFFIX; `reward_model.ground_truth` is the
        final number as a string (verl's reward compares strings); `extra_info` keeps the split,
        the index, the raw question and the worked solution (the SFT warm-start target).
        """
        rows = []
        for i, ex in enumerate(self.dataset(split, size)):
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": ex["question"] + INSTRUCTION_SUFFIX}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": ex["ground_truth"]},
                    "extra_info": {
                        "split": split,
                        "index": i,
                        "answer": ex["answer"],
                        "question": ex["question"],
                    },
                }
            )
        return rows

    def write_parquet(self, path: str | os.PathLike[str], split: str, size: int) -> Path:
        """Write `to_verl_rows(split, size)` as a verl-format parquet file; return its path."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from aqn_jax.data.gsm8k import verl_schema

        rows = self.to_verl_rows(split, size)
        table = pa.Table.from_pylist(rows, schema=verl_schema())
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out)
        return out

    def write_jsonl(self, path: str | os.PathLike[str], split: str, size: int) -> Path:
        """Write raw GSM8K-format jsonl ({"question", "answer"} per line); return its path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for ex in self.dataset(split, size):
                record = {"question": ex["question"], "answer": ex["answer"]}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return out
