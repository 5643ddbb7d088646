"""Scoring a sampler on held-out problems: verl's reward of each example's completions (the
trainer's validation, the severity job and the robustness matrix all score this way)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from aqn_jax.data.gsm8k import Example, left_pad
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.rewards import extract_solution, score_batch
from aqn_jax.rl.sampler import Sampler


def eval_scores(
    sampler: Sampler,
    params,
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    batch_size: int,
    max_prompt_len: int,
    fault_key=None,
    values=None,
    key=None,
    texts: list[str] | None = None,
    method: str = "strict",
    ended: list[bool] | None = None,
    records: list[dict[str, Any]] | None = None,
) -> np.ndarray:
    """verl scores (`method`: strict `####` | flexible) of `sampler`'s completions for every
    example, in order (the last batch padded with repeats of its first prompt, which are
    dropped); with `sampler.sampling.n > 1` each example's score is the mean over its n samples
    (mean@n).
    `texts`, when given, receives the decoded completions (n per example, in order); `ended`,
    whether each of them emitted a stop id (False: cut at the token budget); `records`, one
    dict a completion (`record`: the problem, the response, its reading and score)."""
    n = sampler.sampling.n
    scores = []
    ended_all: list[bool] = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        real = len(chunk)
        chunk += [chunk[0]] * (batch_size - real)
        ids = [tokenizer.encode_chat(ex.prompt_messages) for ex in chunk]
        width = max(len(i) for i in ids)
        if width > max_prompt_len:
            raise ValueError(
                f"a validation prompt has {width} tokens > config.rollout.max_prompt_len="
                f"{max_prompt_len}"
            )
        arr, mask = left_pad(ids, tokenizer.pad_id, width)
        k = jax.random.key(0) if key is None else jax.random.fold_in(key, start)
        out = sampler(
            params, arr, mask, k, fault_key=k if fault_key is None else fault_key, values=values
        )
        texts_of_batch = [
            tokenizer.decode(t[m > 0]) for t, m in zip(out.tokens, out.response_mask, strict=True)
        ]
        truths = [ex.ground_truth for ex in chunk[:real] for _ in range(n)]
        decoded = texts_of_batch[: real * n]
        each = score_batch(decoded, truths, method=method)
        s = each.reshape(real, n).mean(axis=1)
        scores.extend(s.tolist())
        if records is not None:
            lengths = out.response_mask.sum(1)
            for j in range(real * n):
                records.append(
                    record(chunk[j // n], ids[j // n], decoded[j], each[j], method)
                    | {"sample": j % n, "tokens": int(lengths[j]), "ended": bool(out.ended[j])}
                )
        if texts is not None:
            texts.extend(decoded)
        ended_all.extend(out.ended[: real * n].tolist())  # the rows ended on a stop id
    if ended is not None:
        ended.extend(ended_all)
    if ended_all and not any(ended_all):
        print(
            cap_line(f"{sampler.phase}: every one of {len(ended_all)} responses", sampler.sampling)
        )
    return np.asarray(scores, np.float32)


def prompt_hash(ids: Sequence[int]) -> str:
    """The first 16 hex digits of the sha256 of a prompt's token ids (a problem's identity in
    per-problem records: the same index under another prompt format is another problem)."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def record(ex: Example, ids: Sequence[int], response: str, score: float, method: str) -> dict:
    """One completion's per-problem record (the lines of samples.jsonl, before its sample index,
    token count and end): the problem's index and prompt hash, the response text, the answer
    read from it under `method`, the ground truth, and the score (1.0 correct)."""
    return {
        "index": int(ex.index),
        "prompt_sha": prompt_hash(ids),
        "response": response,
        "extracted": extract_solution(response, method),
        "truth": ex.ground_truth,
        "correct": bool(score >= 1.0),
        "score": float(score),
    }


def cap_line(what: str, sampling) -> str:
    """The one line for a call in which no response ended on its own (`what` names it)."""
    stops = sorted({sampling.eos_id, *sampling.stop_ids})
    return (
        f"{what} ran to the {sampling.max_new_tokens}-token cap without a stop id {stops}: the"
        " answers may be cut, or the tokenizer's eos is not the model's end of turn"
    )
