"""Batched generation in one jitted program: prefill + a `lax.while_loop` of single-token steps.

The same Linen module and the same fault interceptor (phase `rollout`) as training: the plan
is entered inside the traced prefill and inside the traced loop body, so the hardware faults
and this step's AQN sigma act on every token the policy generates.

Shapes stay fixed so that XLA compiles once per prompt bucket: prompts are left-padded to the
smallest bucket length >= the longest prompt (`Sampler.buckets`), the KV cache has
`bucket + max_new_tokens` slots, and the loop runs at most `max_new_tokens` steps (it exits
early once every sequence has produced EOS). The cache buffers are kept by the `Sampler`
between calls and donated to the program, which updates them in place.

Log-probs: `logprobs[b, t]` is log softmax(logits / temperature) of the sampled token (plain
log softmax for greedy), the full-vocabulary distribution that the trainer recomputes by a
teacher-forced forward; top-k / top-p only restrict what can be sampled. The drift between the
two is what the trainer logs. A fault with scope 'causal' (faults/intercept.py) keeps its
running statistic per site in the loop state next to the KV cache (`fault_state`), so cached
decoding applies the fault that the trainer's teacher-forced forward applies.

Randomness: sampling keys and fault keys are separate streams folded from the caller's keys
and the token index, so a fault's noise at token t does not depend on how sampling used its
key (and the same keys give the same samples).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import parallel
from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.faults.transforms import DRAW_KEY, STATE_COLLECTION, STATS_COLLECTION
from aqn_jax.forward import forward
from aqn_jax.models.registry import init_cache

NEG_INF = -1e30  # masks logits that may never be sampled (finite: no NaN in log-softmax)
# A shared prefix is a multiple of this many tokens (the rest of the common tokens go with each
# row's own): one program per multiple, not per length.
PREFIX_GRANULE = 16
# A decode that retires its finished rows halves its batch down to this many rows and no
# further: below it a CPU's decode step costs about the same (reading every weight once
# dominates), and every level is one more copy of the step in the program.
RETIRE_MIN_ROWS = 8


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static decoding settings (a change recompiles).

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. vocab_size
    limits sampling to the tokenizer's ids when the model's vocab is padded beyond them.
    """

    max_new_tokens: int
    eos_id: int
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    vocab_size: int | None = None
    # Ids that also end a row, besides eos_id (the tokenizer's `stop_ids`: a model's generation
    # config may list several end-of-turn ids).
    stop_ids: tuple[int, ...] = ()
    # Prefill each distinct prompt once and broadcast its KV cache, last logits and fault state
    # to its n rows (config.rollout.share_prompt); off where the fault plan says the values
    # would differ (`FaultPlan.split_refusals`).
    share_prompt: bool = True
    # Prefill the prefix that every prompt of a call shares (a chat template's system turn, a
    # worked example) once and broadcast its KV cache to every row (config.rollout.share_prefix);
    # off where the fault plan says the values would differ (`FaultPlan.prefix_refusals`).
    share_prefix: bool = True
    # Greedy decoding retires its finished rows (config.rollout.retire_rows): once at most half
    # of the rows still run, the live ones are gathered into a batch half as large, down to
    # RETIRE_MIN_ROWS; off for sampled decoding (its draws are made over the whole batch) and
    # where the fault plan says the values would differ (`FaultPlan.prefix_refusals`).
    retire_rows: bool = False

    def __post_init__(self):
        _check_sampling(self, "")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_sampling(p: Any, prefix: str) -> None:
    """The sampling fields' rules (SamplingParams, or config.rollout with its field path)."""
    if p.max_new_tokens < 1:
        raise ValueError(f"{prefix}max_new_tokens={p.max_new_tokens}; must be >= 1")
    if not p.temperature >= 0:
        raise ValueError(f"{prefix}temperature={p.temperature}; must be >= 0 (0 = greedy)")
    if p.top_k < 0:
        raise ValueError(f"{prefix}top_k={p.top_k}; must be >= 0 (0 = off)")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"{prefix}top_p={p.top_p}; must be in (0, 1] (1 = off)")
    if p.n < 1:
        raise ValueError(f"{prefix}n={p.n}; must be >= 1 (samples per prompt)")


def check_rollout(ro: Any) -> None:
    """`config.rollout`, before anything compiles: SamplingParams' rules under the field names,
    and the prompt length and buckets the batcher and the sampler pad to."""
    _check_sampling(ro, "config.rollout.")
    if ro.max_prompt_len < 1:
        raise ValueError(f"config.rollout.max_prompt_len={ro.max_prompt_len}; must be >= 1")
    buckets = tuple(ro.prompt_buckets)
    bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, (int, np.integer))]
    if not buckets or bad or min(buckets) < 1:
        raise ValueError(
            f"config.rollout.prompt_buckets={buckets}; must be a non-empty tuple of positive ints"
        )


def filter_logits(logits_BV: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with the vocab limit, top-k and top-p applied (NEG_INF out)."""
    logits_BV = logits_BV.astype(jnp.float32)
    V = logits_BV.shape[-1]
    if sampling.vocab_size is not None and sampling.vocab_size < V:
        logits_BV = jnp.where(jnp.arange(V) < sampling.vocab_size, logits_BV, NEG_INF)
    if sampling.greedy:
        return logits_BV
    logits_BV = logits_BV / sampling.temperature
    if sampling.top_k and sampling.top_k < V:
        kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)
    if sampling.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1).
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        keep = mass_before_BV < sampling.top_p
        cutoff_B1 = jnp.min(jnp.where(keep, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, NEG_INF, logits_BV)
    return logits_BV


def _logprob_scale(sampling: SamplingParams) -> float:
    return 1.0 if sampling.greedy else sampling.temperature


@dataclasses.dataclass
class SampleOutput:
    """Host arrays; rows are prompt-major: row b * n + j is sample j of prompt b."""

    prompt_ids: np.ndarray  # [B*n, L] left-padded (the bucket length)
    prompt_mask: np.ndarray  # [B*n, L]
    tokens: np.ndarray  # [B*n, max_new_tokens], pad after EOS
    logprobs: np.ndarray  # [B*n, max_new_tokens], 0 where masked
    response_mask: np.ndarray  # [B*n, max_new_tokens], 1 for generated tokens (EOS included)
    fault_stats: dict[str, Any]  # mean over prefill and decode steps, per stat
    ended: np.ndarray  # [B*n] bool: the row emitted a stop id (False: cut at max_new_tokens)
    # Rows x decode steps the program computed (finished rows included until retired); with
    # rows retired, fewer than rows x the steps run.
    row_steps: int = 0


class Sampler:
    """Jitted sampler for one model, fault plan and set of sampling parameters."""

    def __init__(
        self,
        model: nn.Module,
        sampling: SamplingParams,
        plan: FaultPlan | None = None,
        buckets: tuple[int, ...] = (64, 128, 256, 512, 1024),
        phase: str = "rollout",
        mesh: jax.sharding.Mesh | None = None,
    ):
        """mesh: place prompts and the KV cache with their rows split over ('data', 'fsdp')
        (the trainer's batch sharding; the weights bring their own), so the program compiles
        once and the donated cache keeps its sharding between calls."""
        self.model = model
        self.sampling = sampling  # the sampling parameters (not the model's weights)
        self.plan = plan or FaultPlan()
        self.buckets = tuple(sorted(buckets))
        self.phase = phase
        self.mesh = mesh
        self.traces = 0  # how often the program was traced (tests assert no retrace)
        self._caches: dict[tuple[int, int], Any] = {}
        # Why the prompt is prefilled per row, not per group ([] when it is shared, or n = 1).
        self.unshared = self.plan.split_refusals(phase, split=False) if sampling.n > 1 else []
        if not sampling.share_prompt:
            self.unshared = ["config.rollout.share_prompt=False"]
        share = sampling.n > 1 and not self.unshared
        # Why the prefix common to a call's prompts is not prefilled once ([] when it is).
        self.prefix_refused = self.plan.prefix_refusals(phase)
        if not sampling.share_prefix:
            self.prefix_refused = ["config.rollout.share_prefix=False"]
        # Why finished rows are not retired from the decode ([] when they are).
        self.retire_refused = retire_refusals(sampling, self.plan, phase)
        self._spec = _Program(
            model,
            sampling,
            self.plan,
            phase,
            mesh,
            share,
            on_trace=self._traced,
            retire=not self.retire_refused,
        )
        self._program = jax.jit(functools.partial(generate, self._spec), donate_argnums=(4,))
        self.prefix_calls = 0  # calls that prefilled a shared prefix (tests read it)

    def _traced(self) -> None:
        self.traces += 1

    def bucket(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(
            f"prompt length {length} exceeds the largest bucket {self.buckets[-1]}; raise the"
            " buckets or the max prompt length"
        )

    def __call__(
        self,
        weights,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        key: jax.Array,
        fault_key: jax.Array | None = None,
        values: dict[str, Any] | None = None,
    ) -> SampleOutput:
        """Generate for left-padded prompts `[B, L]`; L is padded up to its bucket here."""
        input_ids = np.asarray(input_ids, np.int32)
        attention_mask = np.asarray(attention_mask, np.int32)
        if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
            raise ValueError(
                f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be"
                " the same [B, L] shape"
            )
        B = input_ids.shape[0]
        bucket, dev_ids, dev_mask, prefix, input_ids, attention_mask = self._inputs(
            input_ids, attention_mask
        )
        if prefix is not None:
            self.prefix_calls += 1
        input_ids = np.repeat(input_ids, self.sampling.n, axis=0)
        attention_mask = np.repeat(attention_mask, self.sampling.n, axis=0)
        rows = B * self.sampling.n
        cache = self._take_cache(rows, bucket)
        fault_key = key if fault_key is None else fault_key
        tokens, logprobs, mask, stats, ended, row_steps, cache = self._program(
            weights, dev_ids, dev_mask, (key, fault_key), cache, dict(values or {}), prefix
        )
        self._caches[(rows, bucket)] = cache
        # Every process gets the whole batch back (an all-gather when it spans several hosts).
        return SampleOutput(
            prompt_ids=input_ids,
            prompt_mask=attention_mask,
            tokens=parallel.to_host(tokens),
            logprobs=parallel.to_host(logprobs),
            response_mask=parallel.to_host(mask),
            fault_stats=jax.tree_util.tree_map(parallel.to_host, stats),
            ended=parallel.to_host(ended).astype(bool),
            row_steps=int(parallel.to_host(row_steps)),
        )

    def _inputs(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """(bucket, the program's prompt rows and mask on the devices, the shared prefix
        `[1, P]` or None, the prompts and mask padded to the bucket) of a call with these
        left-padded `[B, L]` prompts."""
        B, L = input_ids.shape
        bucket = self.bucket(L)
        P = 0 if self.prefix_refused else shared_prefix_len(input_ids, attention_mask)
        pad = bucket - L
        prefix = None
        if P:  # [1, P] once; each row's own tokens left-padded in the bucket's other slots
            prefix, own_ids, own_mask = split_prefix(input_ids, attention_mask, P, bucket)
            prefix = self._put_replicated(prefix)
            dev_ids, dev_mask = self._place(own_ids, own_mask, B)
        input_ids = np.pad(input_ids, ((0, 0), (pad, 0)), constant_values=self.sampling.pad_id)
        attention_mask = np.pad(attention_mask, ((0, 0), (pad, 0)))
        if not P:
            dev_ids, dev_mask = self._place(input_ids, attention_mask, B)
        return bucket, dev_ids, dev_mask, prefix, input_ids, attention_mask

    def compile(
        self, weights, rows: int, bucket: int, keys, values: dict[str, Any], prompts=None
    ) -> None:
        """Lower and compile the program for `rows` rows of prompts `bucket` wide, as a call
        with them runs it (`keys`: the (sampling, fault) keys; only their types matter), and
        leave the KV cache it made in the pool for that call. `prompts`: the call's own
        (input_ids, attention_mask), whose shared prefix's length sets the program's shapes
        (`shared_prefix_len`); without them, a call that shares no prefix."""
        if prompts is None:
            ids = np.zeros((rows // self.sampling.n, bucket), np.int32)
            prompts = (ids, ids)
        ids, mask = (np.asarray(x, np.int32) for x in prompts)
        got, dev_ids, dev_mask, prefix, _, _ = self._inputs(ids, mask)
        if got != bucket or ids.shape[0] * self.sampling.n != rows:
            raise ValueError(
                f"Sampler.compile: prompts {ids.shape} x n={self.sampling.n} fill bucket {got}"
                f" and {ids.shape[0] * self.sampling.n} rows, not {bucket} and {rows}"
            )
        cache = self._take_cache(rows, bucket)
        self._caches[(rows, bucket)] = cache
        self._program.lower(weights, dev_ids, dev_mask, keys, cache, dict(values), prefix).compile()

    def _put_replicated(self, x):
        if self.mesh is None:
            return x
        return parallel.put_global(x, parallel.replicated(self.mesh))

    def _take_cache(self, rows: int, bucket: int):
        """The pool's KV cache for (rows, bucket), taken out of it, or a new one."""
        cache = self._caches.pop((rows, bucket), None)
        if cache is None:
            length = bucket + self.sampling.max_new_tokens
            make = lambda: init_cache(self.model.config, rows, length)
            if self.mesh is None:
                cache = make()
            else:  # created in place on the mesh (no host copy; works across processes)
                shardings = _cache_sharding(self.mesh, jax.eval_shape(make))
                cache = jax.jit(make, out_shardings=shardings)()
        return cache

    def _place(self, ids, mask, prompts: int):
        """The program's prompt rows: each distinct prompt once when it is shared, else each
        repeated n times; split over the mesh (a group's rows may sit on several devices: the
        prompts are replicated when they do not split evenly)."""
        if not self._spec.share:
            ids, mask = (np.repeat(a, self.sampling.n, axis=0) for a in (ids, mask))
        if self.mesh is None:
            return ids, mask
        if self._spec.share and prompts % parallel.batch_divisor(self.mesh):
            rep = parallel.replicated(self.mesh)
            return parallel.put_global((ids, mask), (rep, rep))
        return parallel.put_batch((ids, mask), self.mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    """What decides a sampler's program: the model, the sampling parameters, the fault plan and
    phase, and the mesh; `on_trace` is called each time the program is traced."""

    model: nn.Module
    sampling: SamplingParams
    plan: FaultPlan
    phase: str
    mesh: jax.sharding.Mesh | None
    share: bool  # one prefill per distinct prompt, broadcast to its n rows
    on_trace: Callable[[], None]
    retire: bool = False  # finished rows retired from the decode (`retire_sizes`)


def retire_refusals(sampling: SamplingParams, plan: FaultPlan, phase: str) -> list[str]:
    """Why a decode with `sampling` under `plan` keeps every row to its end, one line each
    (empty: finished rows may be retired). Retiring changes the rows of each decode call, as
    prefilling a prefix in a call of its own does (`FaultPlan.prefix_refusals`), and a sampled
    token is drawn over the whole batch (`jax.random.categorical` of one key): fewer rows, other
    draws."""
    if not sampling.retire_rows:
        return ["config.rollout.retire_rows=False"]
    if not sampling.greedy:
        return [f"sampled decoding (temperature {sampling.temperature:g}) draws over the batch"]
    return plan.prefix_refusals(phase)


def retire_sizes(rows: int, divisor: int = 1) -> tuple[int, ...]:
    """The decode's batch sizes when it retires finished rows: `rows`, then each half while the
    half is whole, at least RETIRE_MIN_ROWS and splits over `divisor` devices."""
    sizes = [rows]
    while sizes[-1] % 2 == 0:
        half = sizes[-1] // 2
        if half < max(RETIRE_MIN_ROWS, divisor) or half % divisor:
            break
        sizes.append(half)
    return tuple(sizes)


def shared_prefix_len(input_ids: np.ndarray, attention_mask: np.ndarray) -> int:
    """The length of the prefix that every left-padded prompt of `[B, L]` starts with, rounded
    down to a multiple of PREFIX_GRANULE and leaving each row at least one token of its own
    (its last logits come from the second call); 0 for a single prompt or none to share."""
    if input_ids.shape[0] < 2:
        return 0
    lengths = attention_mask.sum(1)
    shortest = int(lengths.min())
    if shortest < 2:
        return 0
    L = input_ids.shape[1]
    start = L - lengths  # left padding: row i's tokens are input_ids[i, start_i:]
    cols = start[:, None] + np.arange(shortest - 1)[None, :]
    real = np.take_along_axis(input_ids, cols, axis=1)
    same = (real == real[:1]).all(axis=0)
    common = shortest - 1 if same.all() else int(np.argmin(same))
    return common // PREFIX_GRANULE * PREFIX_GRANULE


def split_prefix(input_ids: np.ndarray, attention_mask: np.ndarray, P: int, bucket: int):
    """([1, P] the shared prefix, [B, bucket - P] each row's own tokens left-padded, their mask):
    the cache's slots are then the prefix, the padding, the row's own tokens, as the positions
    (a count of real tokens) of today's layout, with the padding moved after the prefix."""
    B, L = input_ids.shape
    lengths = attention_mask.sum(1)
    width = bucket - P
    own = np.zeros((B, width), np.int32)
    own_mask = np.zeros((B, width), np.int32)
    for i in range(B):
        tail = input_ids[i, L - lengths[i] + P :]
        own[i, width - len(tail) :] = tail
        own_mask[i, width - len(tail) :] = 1
    prefix = input_ids[:1, L - lengths[0] : L - lengths[0] + P].astype(np.int32)
    return prefix, own, own_mask


def _cache_sharding(mesh, cache):
    """The KV cache's rows split over ('data', 'fsdp'); scalars replicated."""
    return jax.tree_util.tree_map(
        lambda x: (
            parallel.replicated(mesh) if x.ndim == 0 else parallel.batch_sharding(mesh, x.ndim)
        ),
        cache,
    )


def _forward(p: _Program, weights, ids, mask, cache, fault_state, fault_key, values):
    """One prefill or decode step of program `p`. fault_state: the running statistics of
    causal-scope faults (`faults.intercept`), carried next to the KV cache ({} before the
    prefill)."""
    (logits, cache), state = forward(
        p.model,
        weights,
        ids,
        mask,
        plan=p.plan,
        phase=p.phase,
        key=fault_key,
        values=values,
        state={STATE_COLLECTION: fault_state} if fault_state else None,
        mutable=[STATS_COLLECTION, STATE_COLLECTION],
        cache=cache,
        last_only=True,  # only the next token's logits are needed
    )
    return logits, cache, state.get(STATS_COLLECTION, {}), state.get(STATE_COLLECTION, {})


def generate(p: _Program, weights, input_ids, attention_mask, keys, cache, values, prefix=None):
    """Prefill, then a `while_loop` of one-token steps: (tokens, logprobs, mask, fault stats,
    ended, cache). Jitted per `Sampler` with `p` bound and the cache donated. `prefix`: `[1, P]`
    tokens every prompt starts with, prefilled once (`input_ids` are then each row's own)."""
    p.on_trace()
    sp = p.sampling
    key, fault_key = keys
    # One device state over the whole rollout: a draw of the weights as the device holds them
    # (AQN's norm weights) is made once, for the prefill and every decode step.
    typed = jnp.issubdtype(fault_key.dtype, jax.dtypes.prng_key)
    values = {**values, DRAW_KEY: jax.random.key_data(fault_key) if typed else fault_key}
    rows = input_ids.shape[0] * (sp.n if p.share else 1)
    prefill_key = jax.random.fold_in(fault_key, 0)
    logits, cache, stats, fault_state = _prefill(
        p, weights, input_ids, attention_mask, cache, prefill_key, values, prefix
    )
    T = sp.max_new_tokens
    state = dict(
        t=jnp.zeros((), jnp.int32),
        cache=cache,
        fault_state=fault_state,
        logits=logits[:, -1],  # left padding: the last slot is every prompt's last token
        tokens=jnp.full((rows, T), sp.pad_id, jnp.int32),
        logprobs=jnp.zeros((rows, T), jnp.float32),
        mask=jnp.zeros((rows, T), jnp.int32),
        done=jnp.zeros((rows,), bool),
        stats_sum=stats,
        row_steps=jnp.zeros((), jnp.int32),
    )

    def cond(s):
        return (s["t"] < T) & ~jnp.all(s["done"])

    body = functools.partial(_decode_step, p, weights, key, fault_key, values)
    divisor = 1 if p.mesh is None else parallel.batch_divisor(p.mesh)
    sizes = retire_sizes(rows, divisor) if p.retire else (rows,)
    if len(sizes) == 1:
        s = jax.lax.while_loop(cond, body, state)
        ended = s["done"]
    else:
        s = _retiring_decode(p, state, sizes, cond, body)
        ended = s["ended"].at[s["orig"]].set(s["done"])
        # The pool's buffers keep the call's shape (the next call zeroes or replaces them).
        s["cache"] = jax.tree_util.tree_map(jnp.zeros_like, cache)
    if p.mesh is not None:
        s["cache"] = jax.lax.with_sharding_constraint(
            s["cache"], _cache_sharding(p.mesh, s["cache"])
        )
    # Telemetry: the mean over the prefill and every decode step that ran.
    stats = jax.tree_util.tree_map(lambda v: v / (s["t"] + 1).astype(v.dtype), s["stats_sum"])
    return s["tokens"], s["logprobs"], s["mask"], stats, ended, s["row_steps"], s["cache"]


def _retiring_decode(p: _Program, state: dict, sizes: tuple[int, ...], cond, body) -> dict:
    """The decode loop in levels of `sizes` rows: each level runs while more rows are live than
    the next level holds, then the live rows (in their order) and as many finished ones as fill
    the next level are gathered into it. `orig` maps a level's rows to the call's, where every
    token is written; `ended` holds the finished state of the rows left behind. Each row's
    computation is the one it has in the full batch: its cache slots, positions and fault state
    go with it, and no call-wide value is allowed here (`retire_refusals`)."""
    rows = sizes[0]
    s = dict(state, orig=jnp.arange(rows, dtype=jnp.int32), ended=jnp.zeros((rows,), bool))
    for i, size in enumerate(sizes):
        if i:
            s = _retire(p, s, size)
        below = sizes[i + 1] if i + 1 < len(sizes) else 0
        s = jax.lax.while_loop(
            lambda s, below=below: cond(s) & (jnp.sum(~s["done"]) > below), body, s
        )
    return s


def _retire(p: _Program, s: dict, size: int) -> dict:
    """The loop state `s` with its rows cut to `size`: the live ones first, in their order (at
    most `size` of them live when the level before ended early)."""
    ended = s["ended"].at[s["orig"]].set(s["done"])
    keep = jnp.argsort(s["done"], stable=True)[:size]
    rows = lambda tree: jax.tree_util.tree_map(lambda x: x[keep] if x.ndim else x, tree)  # noqa: E731
    cache = rows(s["cache"])
    if p.mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(p.mesh, cache))
    return dict(
        s,
        cache=cache,
        fault_state=rows(s["fault_state"]),
        logits=s["logits"][keep],
        done=s["done"][keep],
        orig=s["orig"][keep],
        ended=ended,
    )


def _prefill(p: _Program, weights, input_ids, attention_mask, cache, prefill_key, values, prefix):
    """The prompts' pass: (last logits, KV cache, fault stats, fault state) of every row."""
    sp = p.sampling
    if prefix is not None:
        return _prefill_prefix(p, weights, prefix, input_ids, attention_mask, prefill_key, values)
    if p.share:
        # One prefill per distinct prompt ([B, L], a fresh cache of B rows), then its KV
        # cache, last logits and fault state repeated to the group's n rows. A random fault
        # on the prompt's positions is drawn once per group, as on hardware that serves the
        # prompt once.
        length = input_ids.shape[1] + sp.max_new_tokens  # the pool's cache's slots
        fresh = init_cache(p.model.config, input_ids.shape[0], length)
        logits, fresh, stats, fault_state = _forward(
            p, weights, input_ids, attention_mask, fresh, {}, prefill_key, values
        )
        logits, fresh, fault_state = jax.tree_util.tree_map(
            lambda x: jnp.repeat(x, sp.n, axis=0) if x.ndim else x, (logits, fresh, fault_state)
        )
        cache = fresh
        if p.mesh is not None:  # the group's rows split over the mesh as the others are
            cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(p.mesh, cache))
        return logits, cache, stats, fault_state
    # Reuse the donated buffers, zeroed: a padding query has no valid key, and its softmax over
    # all-masked slots would average whatever an earlier call left there. Its output never
    # reaches a real token, but it enters tensor-wide statistics (a deadzone's amax, the
    # telemetry), so a run must not depend on what the cache held before.
    cache = jax.tree_util.tree_map(jnp.zeros_like, cache)
    return _forward(p, weights, input_ids, attention_mask, cache, {}, prefill_key, values)


def _prefill_prefix(p: _Program, weights, prefix, own_ids, own_mask, prefill_key, values):
    """The shared prefix `[1, P]` into a one-row cache, broadcast to every prompt's row, then
    each row's own tokens `[B, W]` after it (then to each group's n rows when the prompt is
    shared). The telemetry is the slot-weighted mean of the two calls, as a prefill over the
    P + W slots of every row would average it."""
    sp = p.sampling
    P, B, W = prefix.shape[1], own_ids.shape[0], own_ids.shape[1]
    length = P + W + sp.max_new_tokens  # the pool's cache's slots
    one = init_cache(p.model.config, 1, length)
    ones = jnp.ones((1, P), jnp.int32)
    _, one, stats_p, fault_state = _forward(p, weights, prefix, ones, one, {}, prefill_key, values)
    cache, fault_state = jax.tree_util.tree_map(
        lambda x: jnp.repeat(x, B, axis=0) if x.ndim else x, (one, fault_state)
    )
    if p.mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(p.mesh, cache))
    logits, cache, stats_o, fault_state = _forward(
        p, weights, own_ids, own_mask, cache, fault_state, prefill_key, values
    )
    stats = jax.tree_util.tree_map(lambda a, b: (a * P + b * W) / (P + W), stats_p, stats_o)
    if p.share:
        logits, cache, fault_state = jax.tree_util.tree_map(
            lambda x: jnp.repeat(x, sp.n, axis=0) if x.ndim else x, (logits, cache, fault_state)
        )
        if p.mesh is not None:
            cache = jax.lax.with_sharding_constraint(cache, _cache_sharding(p.mesh, cache))
    return logits, cache, stats, fault_state


def _decode_step(p: _Program, weights, key, fault_key, values, s):
    """One step of the decode loop: sample token `s['t']` from the last logits, record it and
    its log-prob, and run it through the model (the loop state `s` -> the next one)."""
    sp = p.sampling
    t = s["t"]
    filtered = filter_logits(s["logits"], sp)
    if sp.greedy:
        token = jnp.argmax(filtered, axis=-1).astype(jnp.int32)
    else:
        token = jax.random.categorical(jax.random.fold_in(key, t), filtered).astype(jnp.int32)
    scaled = s["logits"].astype(jnp.float32) / _logprob_scale(sp)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], axis=-1)[:, 0]
    live = ~s["done"]
    token = jnp.where(live, token, sp.pad_id)
    # The call's rows this batch's rows are (`_retiring_decode`); all of them in order if none.
    at = s["orig"] if "orig" in s else slice(None)
    tokens = s["tokens"].at[at, t].set(token)
    logprobs = s["logprobs"].at[at, t].set(jnp.where(live, logprob, 0.0))
    mask = s["mask"].at[at, t].set(live.astype(jnp.int32))
    done = s["done"] | (token == sp.eos_id)
    for stop in sp.stop_ids:
        if stop != sp.eos_id:
            done = done | (token == stop)
    # Finished rows feed padding (mask 0): their slots stay invalid in the cache.
    logits, cache, stats, fault_state = _forward(
        p,
        weights,
        token[:, None],
        live[:, None].astype(jnp.int32),
        s["cache"],
        s["fault_state"],
        jax.random.fold_in(fault_key, t + 1),
        values,
    )
    return dict(
        s,
        t=t + 1,
        cache=cache,
        fault_state=fault_state,
        logits=logits[:, -1],
        tokens=tokens,
        logprobs=logprobs,
        mask=mask,
        done=done,
        stats_sum=jax.tree_util.tree_map(jnp.add, s["stats_sum"], stats),
        row_steps=s["row_steps"] + token.shape[0],
    )
