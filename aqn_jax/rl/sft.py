"""Supervised warm start: teach the policy the task's answer format before RL.

RL from a random tiny model never sees a reward; the original study started from an instruct
model that already answered GSM8K in the `#### N` format. The embedded default gets there with
a short SFT on the task's worked solutions: each sequence is the prompt rendered through the
chat template (with the generation prompt), then the worked solution and EOS; the loss is the
token-mean cross-entropy over the solution tokens and EOS only.

SFT runs on the clean model (no fault plan): the warm start stands for the pretrained model a
researcher brings to the faulty device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from aqn_jax.data.gsm8k import Example
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.forward import token_nll

from .optim import adamw, lr_schedule


@dataclasses.dataclass(frozen=True)
class SFTData:
    """Left-padded SFT sequences: ids / attention mask / loss mask, all `[N, L]` int32."""

    ids: np.ndarray
    mask: np.ndarray
    loss_mask: np.ndarray


def sft_sequences(
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    max_len: int | None = None,
    multiple: int = 16,
) -> SFTData:
    """Tokenise prompt + worked solution + EOS, left-padded to `max_len` (default: the longest,
    rounded up to `multiple`). Raises naming the example when one has no worked solution or is
    longer than `max_len`."""
    rows = []
    for pos, ex in enumerate(examples):
        if not ex.answer:
            raise ValueError(
                f"SFT example index {ex.index} (position {pos}) has no worked solution (answer);"
                " the warm start trains on answers: use a dataset with extra_info.answer"
            )
        prompt = tokenizer.encode_chat(ex.prompt_messages)
        response = tokenizer.encode(ex.answer) + [tokenizer.eos_id]
        rows.append((prompt, response))
    longest = max(len(p) + len(r) for p, r in rows)
    if max_len is None:
        max_len = -(-longest // multiple) * multiple
    elif longest > max_len:
        raise ValueError(f"SFT sequences reach {longest} tokens > max_len={max_len}")
    n = len(rows)
    ids = np.full((n, max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((n, max_len), np.int32)
    loss_mask = np.zeros((n, max_len), np.int32)
    for i, (p, r) in enumerate(rows):
        seq = p + r
        ids[i, max_len - len(seq) :] = seq
        mask[i, max_len - len(seq) :] = 1
        loss_mask[i, max_len - len(r) :] = 1
    return SFTData(ids, mask, loss_mask)


def sft_loss(model: nn.Module, params, ids, mask, loss_mask) -> jax.Array:
    """Token-mean next-token cross-entropy over the positions where `loss_mask` is 1 (the head
    a chunk of positions at a time: `forward.Readout`)."""
    total, count = token_nll(model, params, ids, mask, loss_mask)
    return total / jnp.maximum(count, 1.0)


def sft_train(
    model: nn.Module,
    params: Any,
    data: SFTData,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    weight_decay: float = 0.0,
    seed: int = 0,
    callback: Callable[[int, float], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """AdamW SFT for `steps` steps of `batch_size` sequences (epochs of a permutation seeded by
    (seed, epoch), drop-last). Returns (params, {"loss": [per step], "wall_time_s": ...}).
    `callback(step, loss)` is called after every step (progress bars)."""
    n = len(data.ids)
    if batch_size > n:
        raise ValueError(f"SFT batch_size={batch_size} > {n} examples")
    opt = adamw(
        lr_schedule(lr, steps, warmup_steps=warmup_steps, schedule=schedule, field="config.sft"),
        weight_decay=weight_decay,
        field="config.sft",
    )

    @jax.jit
    def step_fn(params, opt_state, ids, mask, loss_mask):
        loss, grads = jax.value_and_grad(lambda p: sft_loss(model, p, ids, mask, loss_mask))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    per_epoch = n // batch_size
    losses: list[float] = []
    t0 = time.perf_counter()
    perm = None
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        if k == 0 or perm is None:
            perm = np.random.default_rng([seed, epoch]).permutation(n)
        pick = perm[k * batch_size : (k + 1) * batch_size]
        params, opt_state, loss = step_fn(
            params, opt_state, data.ids[pick], data.mask[pick], data.loss_mask[pick]
        )
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"SFT step {step}: loss={loss}")
        losses.append(loss)
        if callback is not None:
            callback(step, loss)
    return params, {"loss": losses, "wall_time_s": time.perf_counter() - t0}
