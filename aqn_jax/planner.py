"""Per-device memory plan of the RL train job, made before anything compiles.

`estimate` sizes what one device of the mesh holds from the *shapes* alone: the params, optimizer
state and KV caches from `jax.eval_shape` (no compile, no allocation), the activations from a
stated analytic model. The mesh enters only through its shape (data, fsdp, tensor), so a
64- or 256-device mesh can be planned on a laptop. `check` compares the estimate with the
device memory and refuses a run that would not fit, naming the mesh, the components, and a
mesh (or remat / micro-batch setting) that fits, as command-line flags.

Sharding follows the trainer: every array is split by its logical axes
(`parallel.DEFAULT_RULES`: embed -> fsdp; heads, kv_heads, mlp, vocab -> tensor; a dim of size
n on axes of total size k holds ceil(n / k) per device); batch rows and the KV caches are split
over data x fsdp (`rl.sampler._cache_sharding`), not over tensor.

Components (bytes per device):

  always held (the train state and the samplers' buffers)
    params           the master weights (`param_dtype`)
    optimizer        AdamW moments (two param copies) and its counters
    reference        a frozen copy of params (algo.use_kl_loss or use_kl_in_reward)
    critic           the value model's params and its AdamW state (algo.estimator='gae')
    rollout_weights  params cast to `dtype` for generation (0 when dtype == param_dtype)
    kv_cache         the rollout sampler's caches: prompts * n rows, one cache per prompt bucket
                     the run can reach (the sampler keeps every bucket's cache between calls)
    val_kv_cache     the validation samplers' caches (trainer.val_batch_size rows; one sampler
                     on a clean device, two when the hardware faults act in phase 'eval')
  one program at a time (the peak of these is added to the above)
    rollout          generation: the prefill's working set of one decoder layer
    prepare          old/reference log-probs: forwards over the update's micro-batches, one
                     micro-batch at a time (`lax.map`)
    update           gradients (one param-sized accumulator, in param_dtype as
                     `zeros_like(params)`) + activations of one micro-batch's forward+backward
                     + compute_weights: the weights cast to `dtype` inside the program (as
                     rollout_weights; 0 when dtype == param_dtype), which the backward keeps
                     (dX = g W^T reads the cast W)
    optimizer step   gradients + the param-sized update tree of the AdamW step

Activation model. Per device: r rows (the micro-batch's rows / (data * fsdp) in the update and
in prepare, all prompts * n rows / (data * fsdp) in generation), T = bucket + max_new_tokens
positions, R = max_new_tokens response positions, tensor size t, compute itemsize c, and
N, K, H, D, I, L, V the model's heads, kv heads, head dim, hidden, mlp, layers and vocab.
Attention scores and probabilities are float32 and materialised (`Qwen2Attention`): s copies
of (N / t) * S * 4 bytes per token over S key positions. Per token, a decoder layer

  saves for its backward   (6 D + 3 (N + K) H / t + 4 I / t) * c + 3 (N / t) T * 4
                           (x, both norms' outputs, h, the o_proj and down_proj outputs; q, k,
                           v, roped q and k, the attention output; gate, up, silu, product)
  holds in a forward       3 (I / t) * c + s (N / t) S * 4
                           (gate, up and their product; s = 3 over S = T keys in a full
                           forward, s = 2 over S = bucket + max_new cache slots in a prefill;
                           the D-sized tensors are small beside these, I / D ~ 5.5 in Qwen2.5)

  update (activations)  layers: without remat L * r * T * saved;  with remat (each layer's
                        input only, plus one layer recomputed in its backward)
                        L * r * T * D * c + r * T * saved
                        readout: 4 r c V / t * 4 + 2 r R D * 4 (+ V / t * D * 4 when the head
                        is trained)
  prepare               r * T * forward + 2 r c V / t * 4
                        (one layer at a time; the readout's chunk)
  generation            r * bucket * forward (the prefill; the decode steps and the
                        last-position logits are small)

The log-probs never hold the logits of every position (`aqn_jax/logprobs.py`): the
head runs on c = min(config.model.logprob_chunk, R) response positions of the r rows at a time,
under `jax.checkpoint`. The update holds four float32 copies of one chunk's logits (the
recomputed logits, their exponentials, the softmax, their gradient), the response's hidden
states and their gradient in float32 (2 r R D * 4) and, when the head is trained (full
fine-tuning), the head's float32 gradient accumulated over the chunks (the `lax.map`'s carry);
prepare's forward two chunk copies (the logits and their exponentials). In bfloat16 XLA also
keeps the head's weights cast to bf16 (twice when tied): the update's compute_weights counts
them; prepare's plan does not.

compute_weights: with compute in `dtype` below `param_dtype`, XLA holds each layer's weights cast
to `dtype` until the backward has read them (read off XLA:CPU's buffer assignment of a
micro-batch's gradient).

The copy counts were read off XLA's buffer assignment (`compiled.memory_analysis()`) on
XLA:CPU for the trainer's own loss functions, and tests/test_planner.py compares the estimates
with compiled programs of the tiny model. XLA:CPU does not honour remat (its temp size is the
same with and without `nn.remat`), so the remat formula is the stated model, not a
measurement. Not counted: XLA's scratch and fragmentation (the reason for `headroom`), the
host-side batch and the sampler's small per-token outputs.

On a CPU backend the devices are the host: a process's peak RSS is then every device's plan plus
what only the host holds, `cpu_rss` = devices x total + host_params + RUNTIME_BYTES: the job's
host copy of the loaded params (the warm start's tree stays referenced for the whole run) and
the runtime (jax/XLA, the compiled programs, torch and the tokenizer, the data). With remat the
CPU total counts the activations without it, since XLA:CPU does not honour remat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from aqn_jax import lora as lora_lib
from aqn_jax import parallel, quant_base
from aqn_jax.lora import LoraSpec
from aqn_jax.models.registry import ModelConfig, causal_lm, family_of, init_cache
from aqn_jax.rl.optim import OptimizerSpec

GIB = 2**30
# What a CPU run's process holds besides the plan's arrays (jax/XLA and the compiled programs,
# torch, the tokenizer, the data): about 3 GiB measured at 0.5B; 5 GiB keeps a margin.
RUNTIME_BYTES = 5 * GIB
# The LoRA rank a refused CPU plan suggests (`check_host`): QeRL's 16-32 (verl's advice: >= 32).
HOST_LORA_RANK = 32
RESIDENT = (
    "params",
    "optimizer",
    "reference",
    "critic",
    "rollout_weights",
    "kv_cache",
    "val_kv_cache",
)
# The programs that run one at a time, and the components each adds to the resident ones.
PHASES: dict[str, tuple[str, ...]] = {
    "rollout": ("generation", "dequantized_base"),
    "prepare": ("prepare", "dequantized_base"),
    "update": ("gradients", "activations", "compute_weights", "dequantized_base"),
    "optimizer step": ("gradients", "optimizer_step"),
}
COMPONENTS = RESIDENT + (
    "generation",
    "prepare",
    "gradients",
    "activations",
    "optimizer_step",
    "compute_weights",
    "dequantized_base",
)
_BATCH = P(parallel.BATCH_AXES)  # axis 0 over (data, fsdp), the rest whole


def check_planner(section: Any) -> None:
    """Raise naming the field of `config.planner` that is out of range."""
    if not 0.0 < float(section.headroom) <= 1.0:
        raise ValueError(
            f"config.planner.headroom={section.headroom}; must be in (0, 1] (the fraction of the"
            " device memory the estimate may use)"
        )
    if float(section.device_memory_gb) < 0:
        raise ValueError(
            f"config.planner.device_memory_gb={section.device_memory_gb}; must be >= 0"
            " (0 = detect from the device)"
        )


def detect_capacity() -> int | None:
    """Bytes one local device may allocate (`memory_stats()['bytes_limit']`), or None when the
    backend reports nothing (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The estimate for one device of a (data, fsdp, tensor) mesh.

    components: bytes per component (`COMPONENTS`); total: the resident ones plus the largest
    phase (`PHASES`), named by `peak_phase`. capacity: device bytes (None: unknown); fits is
    True when capacity is unknown, else total <= headroom * capacity.
    """

    mesh: tuple[int, int, int]
    components: Mapping[str, int]
    total: int
    peak_phase: str
    remat: bool
    micro_batch_rows: int
    capacity: int | None = None
    headroom: float = 0.9
    host_params: int = 0  # the job's host copy of the whole params tree (bytes)
    # The device total with the activations of no remat: XLA:CPU does not honour remat, so a
    # CPU process's peak is bounded with it (module docstring). 0 = the same as `total`.
    cpu_total: int = 0
    # On a CPU backend: the host's memory (`host_memory`) that `cpu_rss` is checked against.
    host_memory: int | None = None
    host_source: str = ""

    @property
    def cpu_rss(self) -> int:
        """Peak RSS of one CPU process holding every device of the mesh (module docstring)."""
        total = max(self.total, self.cpu_total)
        return math.prod(self.mesh) * total + self.host_params + RUNTIME_BYTES

    @property
    def budget(self) -> int | None:
        """Bytes the estimate may use: headroom * capacity (None when capacity is unknown)."""
        return None if self.capacity is None else int(self.headroom * self.capacity)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    @property
    def host_budget(self) -> int | None:
        """Bytes a CPU process may use: headroom * the host's memory (None: not a CPU plan)."""
        return None if self.host_memory is None else int(self.headroom * self.host_memory)

    @property
    def fits_host(self) -> bool:
        return self.host_budget is None or self.cpu_rss <= self.host_budget

    @property
    def mesh_flag(self) -> str:
        """`config.mesh=(data=.., fsdp=.., tensor=..)` with the resolved sizes."""
        return (
            "config.mesh=("
            + ", ".join(f"{a}={s}" for a, s in zip(parallel.AXES, self.mesh, strict=True))
            + ")"
        )

    def phase_bytes(self, phase: str) -> int:
        return sum(self.components[c] for c in PHASES[phase])

    def table(self) -> str:
        """The components in GiB, the peak phase marked, and the verdict."""
        when = {c: "always" for c in RESIDENT}
        for phase, parts in PHASES.items():
            for c in parts:
                when[c] = f"{when[c]}, {phase}" if c in when else phase
        lines = [
            f"memory per device: {self.mesh_flag}, remat={self.remat},"
            f" micro_batch_rows={self.micro_batch_rows}",
            f"  {'component':16s} {'GiB':>9s}  held during",
        ]
        for c in COMPONENTS:
            mark = "  <- peak" if c in PHASES[self.peak_phase] else ""
            lines.append(f"  {c:16s} {self.components[c] / GIB:9.2f}  {when[c]}{mark}")
        lines.append(
            f"  {'total':16s} {self.total / GIB:9.2f}  always + {self.peak_phase}"
            f" ({self.phase_bytes(self.peak_phase) / GIB:.2f})"
        )
        lines.append(
            f"  {'CPU process RSS':16s} {self.cpu_rss / GIB:9.2f}  on a CPU backend: every device +"
            f" the host's params ({self.host_params / GIB:.2f}) + runtime"
            f" ({RUNTIME_BYTES / GIB:.2f})"
            + (
                f"; the devices without remat ({self.cpu_total / GIB:.2f}: XLA:CPU ignores it)"
                if self.cpu_total > self.total
                else ""
            )
        )
        if self.capacity is None and self.host_memory is not None:
            verdict = "fits" if self.fits_host else "DOES NOT FIT"
            lines.append(
                f"  {'host memory':16s} {self.host_memory / GIB:9.2f}  ({self.host_source}) x"
                f" headroom {self.headroom:g} = {self.host_budget / GIB:.2f} GiB for the CPU"
                f" process RSS: {verdict}"
            )
        elif self.capacity is None:
            lines.append("  capacity unknown (the backend reports no memory limit): not checked")
        else:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(
                f"  {'capacity':16s} {self.capacity / GIB:9.2f}  x headroom {self.headroom:g} ="
                f" {self.budget / GIB:.2f} GiB: {verdict}"
            )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A setting as command-line flags (mesh, remat, micro-batch) and its plan."""

    flags: tuple[str, ...]
    plan: MemoryPlan

    def __str__(self) -> str:
        return f"{' '.join(self.flags)} (est. {self.plan.total / GIB:.1f} GiB per device)"


# --- shapes -> per-device bytes -----------------------------------------------------------------
class _Group(NamedTuple):
    """`count` arrays of one shape, itemsize and placement (mesh axes per dim)."""

    shape: tuple[int, ...]
    itemsize: int
    spec: tuple[tuple[str, ...], ...]
    count: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _groups(abstract: Any, specs: Any) -> tuple[_Group, ...]:
    """Group the leaves of a ShapeDtypeStruct tree by (shape, itemsize, PartitionSpec)."""
    counts: Counter = Counter()

    def add(leaf, spec):
        per_dim = tuple(_axes(spec[i]) if i < len(spec) else () for i in range(len(leaf.shape)))
        counts[(tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, per_dim)] += 1

    jax.tree_util.tree_map(add, abstract, specs)
    return tuple(_Group(*key, n) for key, n in counts.items())


def _shard_bytes(groups: tuple[_Group, ...], mesh: Mapping[str, int]) -> int:
    """Bytes one device holds: each dim divided (ceil) by the sizes of its mesh axes."""
    total = 0
    for g in groups:
        n = g.itemsize
        for dim, axes in zip(g.shape, g.spec, strict=True):
            n *= _cdiv(dim, math.prod(mesh[a] for a in axes))
        total += n * g.count
    return total


@functools.lru_cache(maxsize=8)
def _abstract_model(model_cfg: ModelConfig, head: str) -> tuple[Any, Any]:
    """(ShapeDtypeStruct params, PartitionSpec per param) of `causal_lm(cfg, head)`,
    from one eval_shape of init (as `factory.logical_axes`, with the dtypes kept)."""
    model = causal_lm(model_cfg, head=head)
    ids = jax.ShapeDtypeStruct((1, 1), np.int32)
    boxed = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), ids)["params"]
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    specs = jax.tree_util.tree_map(
        lambda box: nn.logical_to_mesh_axes(tuple(box.names), parallel.DEFAULT_RULES),
        boxed,
        is_leaf=is_box,
    )
    return nn.unbox(boxed), specs


def _state_groups(
    optimizer: OptimizerSpec, total_steps: int, params: Any, specs: Any
) -> tuple[_Group, ...]:
    """Groups of the AdamW state of `optimizer` (config.actor's / config.critic's): moments
    follow their params' placement, counters are replicated (as in `Trainer.__init__`)."""
    _, opt = optimizer.build(max(total_steps, 1), 1)
    state = jax.eval_shape(opt.init, params)
    state_specs = optax.tree_map_params(
        opt, lambda _, s: s, state, specs, transform_non_params=lambda _: P()
    )
    return _groups(state, state_specs)


def _cache_groups(model_cfg: ModelConfig, rows: int, lengths: tuple[int, ...], copies: int):
    """Groups of `copies` x one KV cache of `rows` rows per slot count in `lengths`, rows split
    over (data, fsdp) and nothing over tensor (`rl.sampler._cache_sharding`)."""
    groups: list[_Group] = []
    for length in lengths:
        cache = jax.eval_shape(lambda n=length: init_cache(model_cfg, rows, n))
        specs = jax.tree_util.tree_map(lambda x: _BATCH if x.ndim else P(), cache)
        groups += [g._replace(count=g.count * copies) for g in _groups(cache, specs)]
    return tuple(groups)


def reachable_buckets(rollout: Any) -> tuple[int, ...]:
    """The sampler's prompt buckets a run can use: every `rollout.prompt_buckets` entry up to the
    smallest one >= max_prompt_len (prompts are at most that long; all of them if none is)."""
    buckets = sorted(int(b) for b in rollout.prompt_buckets)
    above = [b for b in buckets if b >= int(rollout.max_prompt_len)]
    top = above[0] if above else buckets[-1]
    return tuple(b for b in buckets if b <= top)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the plan reads of the train job (`job_spec`): its model, the mesh as configured,
    the batch shapes, the optimizers and `config.planner`."""

    model: ModelConfig
    mesh: tuple[int, int, int]  # config.mesh (data, fsdp, tensor) as given; -1 = the rest
    total_steps: int
    actor: OptimizerSpec
    critic: OptimizerSpec | None  # None: the estimator has no critic
    rows: int  # prompts * n: the rollout, prepare and update batch
    val_rows: int
    mini_batch_rows: int
    micro_batch_rows: int
    max_new: int
    buckets: tuple[int, ...]  # the reachable prompt buckets (`reachable_buckets`)
    val_samplers: int  # the clean validation sampler, and a faulty one when faults act in 'eval'
    use_ref: bool
    headroom: float  # config.planner
    device_memory_gb: float
    refuse: bool  # config.planner.enabled: refuse a plan that does not fit
    lora: LoraSpec | None = None  # config.lora (QeRL mode when its rank > 0)
    weight_format: str = "none"  # config.model.weight_format: the frozen base's storage
    share_n: int = 1  # config.actor.share_prompt: n when a group's prompt is computed once


@dataclasses.dataclass(frozen=True)
class _Job:
    """What a plan needs from the job and the model, independent of the mesh."""

    model: ModelConfig
    params: tuple[_Group, ...]
    optimizer: tuple[_Group, ...]
    critic: tuple[_Group, ...]  # params + AdamW state; () without a critic
    rollout_weights: tuple[_Group, ...]  # () when dtype == param_dtype
    kv_cache: tuple[_Group, ...]
    val_kv_cache: tuple[_Group, ...]
    rows: int  # prompts * n: the rollout, prepare and update batch
    val_rows: int
    mini_batch_rows: int
    bucket: int  # the largest reachable prompt bucket
    max_new: int
    use_ref: bool
    trainable: tuple[_Group, ...] | None = None  # QeRL mode: the adapters (+ norms)
    dequantized: tuple[_Group, ...] = ()  # a packed base's kernels, dequantised in a program
    host: tuple[_Group, ...] | None = None  # the host's copy: the warm start, before packing
    share_n: int = 1  # the group size when the update computes a prompt once (`JobSpec`)


def _qerl(spec: JobSpec, params, specs):
    """QeRL mode's (base, trainable, optimizer, rollout weights, dequantised kernels) groups:
    a packed base holds each decoder kernel as codes `[out, in / 2]` and scales `[out, in /
    block]` bytes (`quant_base.Packed`) and dequantises it to the compute dtype inside the
    programs (XLA hoists it out of the decode loop: counted while they run); only the adapters
    (+ norms) have gradients and AdamW moments; the reference is the base itself."""
    site_of = family_of(spec.model).site_of
    kernels = set(quant_base.linear_kernel_paths(params, site_of))
    fmt = spec.weight_format
    base, rollout, deq = Counter(), Counter(), Counter()
    itemsize = np.dtype(spec.model.dtype).itemsize
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = tuple(k.key for k in path)
        pspec = quant_base.leaf_at(specs, names)
        per_dim = tuple(_axes(pspec[i]) if i < len(pspec) else () for i in range(leaf.ndim))
        if fmt != "none" and names in kernels:  # stored transposed: (out, in) split as such
            codes, scales, s_global, k = quant_base.packed_shapes(tuple(leaf.shape), fmt)
            s_in, s_out = per_dim
            for a in (codes, scales):
                base[(a.shape, a.dtype.itemsize, (s_out, s_in))] += 1
            base[((), s_global.dtype.itemsize + k.dtype.itemsize, ())] += 1
            deq[(tuple(leaf.shape), itemsize, per_dim)] += 1
        else:
            base[(tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, per_dim)] += 1
            rollout[(tuple(leaf.shape), itemsize, per_dim)] += 1
    trainable = jax.eval_shape(
        lambda p: lora_lib.init_trainable(spec.lora, p, site_of, jax.random.key(0)), params
    )
    tspecs = lora_lib.trainable_axes(spec.lora, specs, site_of)
    tgroups = _groups(trainable, tspecs)
    optimizer = _state_groups(spec.actor, spec.total_steps, trainable, tspecs)
    groups = lambda c: tuple(_Group(*key, n) for key, n in c.items())  # noqa: E731
    rollout_weights: tuple[_Group, ...] = ()
    if spec.model.dtype != spec.model.param_dtype:
        rollout_weights = groups(rollout) + tuple(g._replace(itemsize=itemsize) for g in tgroups)
    return groups(base) + tgroups, tgroups, optimizer, rollout_weights, groups(deq)


@functools.lru_cache(maxsize=16)  # a refusal's search plans variants of one spec repeatedly
def _job(spec: JobSpec) -> _Job:
    model_cfg = spec.model
    shapes_cfg = dataclasses.replace(model_cfg, remat=False)  # remat changes no shape
    params, specs = _abstract_model(shapes_cfg, "lm")
    param_groups = _groups(params, specs)
    optimizer = _state_groups(spec.actor, spec.total_steps, params, specs)
    critic: tuple[_Group, ...] = ()
    if spec.critic is not None:
        cparams, cspecs = _abstract_model(shapes_cfg, "value")
        critic = _groups(cparams, cspecs) + _state_groups(
            spec.critic, spec.total_steps, cparams, cspecs
        )
    rollout_weights: tuple[_Group, ...] = ()
    if model_cfg.dtype != model_cfg.param_dtype:
        itemsize = np.dtype(model_cfg.dtype).itemsize
        rollout_weights = tuple(g._replace(itemsize=itemsize) for g in param_groups)

    trainable, dequantized, host = None, (), param_groups
    if spec.lora is not None and spec.lora.enabled:
        param_groups, trainable, optimizer, rollout_weights, dequantized = _qerl(
            spec, params, specs
        )
    lengths = tuple(b + spec.max_new for b in spec.buckets)
    return _Job(
        model=model_cfg,
        params=param_groups,
        optimizer=optimizer,
        critic=critic,
        rollout_weights=rollout_weights,
        kv_cache=_cache_groups(model_cfg, spec.rows, lengths, 1),
        val_kv_cache=_cache_groups(model_cfg, spec.val_rows, lengths, spec.val_samplers),
        rows=spec.rows,
        val_rows=spec.val_rows,
        mini_batch_rows=spec.mini_batch_rows,
        bucket=spec.buckets[-1],
        max_new=spec.max_new,
        use_ref=spec.use_ref,
        trainable=trainable,
        dequantized=dequantized,
        host=host,
        share_n=spec.share_n,
    )


# --- the activation model ---------------------------------------------------------------------
def saved_layer_bytes(model_cfg: ModelConfig, tensor: int, keys: int) -> int:
    """Bytes one decoder layer saves per token for its backward over `keys` key positions (the
    family's activation model; Qwen2's: `models/qwen2.py:saved_layer_bytes`)."""
    return family_of(model_cfg).saved_layer_bytes(model_cfg, tensor, keys)


def forward_layer_bytes(model_cfg: ModelConfig, tensor: int, keys: int, score_copies: int) -> int:
    """Bytes of one decoder layer's forward working set per token over `keys` key positions."""
    return family_of(model_cfg).forward_layer_bytes(model_cfg, tensor, keys, score_copies)


def readout_bytes(model_cfg: ModelConfig, rows: int, max_new: int, tensor: int, copies: int) -> int:
    """Bytes of `copies` float32 logits of one chunk of the log-prob readout on one device:
    `rows` rows x min(logprob_chunk, max_new) positions x V / t (`aqn_jax/logprobs.py`)."""
    chunk = min(int(model_cfg.logprob_chunk), max_new)
    return copies * rows * chunk * _cdiv(model_cfg.vocab_size, tensor) * 4


def activation_terms(
    model_cfg: ModelConfig,
    rows: int,
    prompt_len: int,
    max_new: int,
    tensor: int,
    remat: bool,
    head_grad: bool = True,
    share: int = 1,
) -> dict[str, int]:
    """Bytes of one micro-batch's forward+backward on one device, `rows` rows of
    `prompt_len + max_new` positions: {'layers': the decoder layers' saved activations,
    'logits': the readout's chunk (four float32 copies: logits, exponentials, softmax,
    gradient), the response's hidden states and their gradient in float32 and, with `head_grad`
    (the head is trained), the head's float32 gradient accumulated over chunks}.

    `share` > 1 (a shared prompt, `forward.SharedPrompt`): rows / share prompts of
    `prompt_len` tokens over their own keys, then `rows` responses of `max_new` tokens over all
    T keys, each row's copy of its prompt's K/V saved for the backward."""
    m = model_cfg
    T = prompt_len + max_new
    itemsize = np.dtype(m.dtype).itemsize
    if share > 1:
        prompts = _cdiv(rows, share)
        tokens = prompts * prompt_len + rows * max_new
        kv = rows * T * 2 * _cdiv(m.num_key_value_heads, tensor) * _head_dim(m) * itemsize
        layer_total = (
            prompts * prompt_len * saved_layer_bytes(m, tensor, prompt_len)
            + rows * max_new * saved_layer_bytes(m, tensor, T)
            + kv
        )
    else:
        tokens = rows * T
        layer_total = tokens * saved_layer_bytes(m, tensor, T)
    if remat:
        layers = m.num_hidden_layers * tokens * m.hidden_size * itemsize + layer_total
    else:
        layers = m.num_hidden_layers * layer_total
    logits = readout_bytes(m, rows, max_new, tensor, 4) + 2 * rows * max_new * m.hidden_size * 4
    if head_grad:
        logits += _cdiv(m.vocab_size, tensor) * m.hidden_size * 4
    return {"layers": layers, "logits": logits}


def prepare_bytes(
    model_cfg: ModelConfig, rows: int, prompt_len: int, max_new: int, tensor: int, share: int = 1
) -> int:
    """Bytes of the prepare program on one device: a forward of `rows` rows (one layer's working
    set at a time) and the readout's chunk (two float32 copies: the logits and their exponentials;
    the policy's and the reference's passes run one after the other); with `share` > 1 the
    responses' call over all T keys is the larger working set (`activation_terms`)."""
    T = prompt_len + max_new
    logits = readout_bytes(model_cfg, rows, max_new, tensor, 2)
    if share > 1:
        return rows * max_new * forward_layer_bytes(model_cfg, tensor, T, 3) + logits
    return rows * T * forward_layer_bytes(model_cfg, tensor, T, 3) + logits


def _head_dim(m: ModelConfig) -> int:
    return getattr(m, "head_dim", None) or m.hidden_size // m.num_attention_heads


def generation_bytes(
    model_cfg: ModelConfig, rows: int, prompt_len: int, max_new: int, tensor: int
) -> int:
    """Bytes of the sampler's prefill on one device: one layer's working set for `rows` rows of
    `prompt_len` queries against `prompt_len + max_new` cache slots (two score copies)."""
    return rows * prompt_len * forward_layer_bytes(model_cfg, tensor, prompt_len + max_new, 2)


def _plan(
    job: _Job,
    mesh: tuple[int, int, int],
    remat: bool,
    micro_batch_rows: int,
    capacity: int | None = None,
    headroom: float = 0.9,
) -> MemoryPlan:
    sizes = dict(zip(parallel.AXES, mesh, strict=True))
    dp, tensor = mesh[0] * mesh[1], mesh[2]
    share = math.gcd(micro_batch_rows, job.share_n)  # rows per prompt (`step.levers`)
    params = _shard_bytes(job.params, sizes)
    trained = params if job.trainable is None else _shard_bytes(job.trainable, sizes)
    act = activation_terms(
        job.model,
        _cdiv(micro_batch_rows, dp),
        job.bucket,
        job.max_new,
        tensor,
        remat,
        head_grad=job.trainable is None,  # QeRL mode: the head is frozen
        share=share,
    )
    components = {
        "params": params,
        "optimizer": _shard_bytes(job.optimizer, sizes),
        # QeRL mode: the reference is the base with the adapters off, no copy.
        "reference": params if job.use_ref and job.trainable is None else 0,
        "critic": _shard_bytes(job.critic, sizes),
        "rollout_weights": _shard_bytes(job.rollout_weights, sizes),
        "kv_cache": _shard_bytes(job.kv_cache, sizes),
        "val_kv_cache": _shard_bytes(job.val_kv_cache, sizes),
        "generation": generation_bytes(
            job.model, _cdiv(max(job.rows, job.val_rows), dp), job.bucket, job.max_new, tensor
        ),
        "prepare": prepare_bytes(
            job.model,
            _cdiv(micro_batch_rows, dp),
            job.bucket,
            job.max_new,
            tensor,
            share,
        ),
        "gradients": trained,
        "activations": act["layers"] + act["logits"],
        "optimizer_step": trained,
        "compute_weights": _shard_bytes(job.rollout_weights, sizes),
        "dequantized_base": _shard_bytes(job.dequantized, sizes),
    }
    phase = {name: sum(components[c] for c in parts) for name, parts in PHASES.items()}
    peak = max(phase, key=phase.get)
    cpu_total = 0
    if remat:
        cpu_total = _plan(job, mesh, False, micro_batch_rows, capacity, headroom).total
    return MemoryPlan(
        mesh=tuple(mesh),
        components=components,
        total=sum(components[c] for c in RESIDENT) + phase[peak],
        peak_phase=peak,
        remat=remat,
        micro_batch_rows=micro_batch_rows,
        capacity=capacity,
        headroom=headroom,
        host_params=_shard_bytes(job.host or job.params, dict.fromkeys(parallel.AXES, 1)),
        cpu_total=cpu_total,
    )


# --- public entry points ----------------------------------------------------------------------
def _mesh(spec: JobSpec, num_devices: int) -> tuple[int, int, int]:
    return parallel.mesh_shape(dict(zip(parallel.AXES, spec.mesh, strict=True)), num_devices)


def estimate(spec: JobSpec, num_devices: int) -> MemoryPlan:
    """Per-device bytes of the train job for its mesh on `num_devices` devices, from shapes
    only (`jax.eval_shape`; nothing is compiled or allocated). The capacity is left unknown."""
    mesh = _mesh(spec, num_devices)
    return _plan(
        _job(spec), mesh, bool(spec.model.remat), spec.micro_batch_rows, headroom=spec.headroom
    )


def _capacity(spec: JobSpec, capacity_bytes: int | None) -> int | None:
    if capacity_bytes is not None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}; must be > 0 (or None)")
        return int(capacity_bytes)
    if spec.device_memory_gb > 0:
        return int(spec.device_memory_gb * GIB)
    return detect_capacity()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splittable(model_cfg: ModelConfig) -> int:
    """The largest tensor size that splits every tensor-sharded dim evenly."""
    m = model_cfg
    return math.gcd(m.num_attention_heads, m.num_key_value_heads, m.intermediate_size, m.vocab_size)


def _settings(
    job: _Job, num_devices: int, remat: bool, micro_batch_rows: int
) -> Iterator[tuple[int, tuple[int, int, int], bool, int]]:
    """(tier, mesh, remat, micro_batch_rows) the train job accepts on `num_devices`: tensor
    divides every tensor-split dim (heads, kv heads, mlp, vocab), fsdp divides the hidden size,
    data x fsdp divides the rollout rows and the micro-batch, which divides the mini-batch.
    Micro-batches: the configured one and every smaller valid one (the smallest valid one when
    data x fsdp exceeds it). Tier 0 changes only the mesh, 1 adds remat, 2 the micro-batch,
    3 both."""
    for tensor in _divisors(num_devices):
        dp = num_devices // tensor
        if _splittable(job.model) % tensor or job.rows % dp:
            continue
        valid = [d for d in _divisors(job.mini_batch_rows) if d % dp == 0]
        micros = [d for d in valid if d <= micro_batch_rows] or valid[:1]
        for fsdp in _divisors(dp):
            if job.model.hidden_size % fsdp:
                continue
            for r, mb in itertools.product(sorted({remat, True}), micros):
                tier = int(r != remat) + 2 * int(mb != micro_batch_rows)
                yield tier, (dp // fsdp, fsdp, tensor), r, mb


def _flags(plan: MemoryPlan, remat: bool, micro_batch_rows: int) -> tuple[str, ...]:
    flags = [f"--config.mesh.{a}={s}" for a, s in zip(parallel.AXES, plan.mesh, strict=True)]
    if plan.remat != remat:
        flags.append(f"--config.model.remat={plan.remat}")
    if plan.micro_batch_rows != micro_batch_rows:
        flags.append(f"--config.actor.micro_batch_rows={plan.micro_batch_rows}")
    return tuple(flags)


def _search(
    job: _Job, num_devices: int, remat: bool, micro: int, capacity: int | None, headroom: float
) -> tuple[list[Suggestion], Suggestion | None]:
    """(the settings that fit, best first: fewest changes, then the smallest estimate; the
    setting with the smallest estimate, fitting or not)."""
    fitting, smallest = [], None
    for tier, mesh, r, mb in _settings(job, num_devices, remat, micro):
        plan = _plan(job, mesh, r, mb, capacity, headroom)
        option = Suggestion(_flags(plan, remat, micro), plan)
        if smallest is None or plan.total < smallest.plan.total:
            smallest = option
        if plan.fits:
            fitting.append((tier, plan.total, option))
    fitting.sort(key=lambda x: x[:2])
    return [s for _, _, s in fitting], smallest


def suggest(spec: JobSpec, num_devices: int, capacity_bytes: int) -> list[Suggestion]:
    """Settings on `num_devices` devices that fit `headroom * capacity_bytes`, best first
    (only the mesh changed, then remat, then a smaller micro-batch; then the smallest
    estimate)."""
    found, _ = _search(
        _job(spec),
        num_devices,
        bool(spec.model.remat),
        spec.micro_batch_rows,
        _capacity(spec, capacity_bytes),
        spec.headroom,
    )
    return found


def check(spec: JobSpec, num_devices: int, capacity_bytes: int | None = None) -> MemoryPlan:
    """`estimate`, then refuse (ValueError) when it exceeds `config.planner.headroom` of the
    device memory: `capacity_bytes`, else `config.planner.device_memory_gb` (GiB), else the
    backend's limit. With no capacity known (CPU) or `config.planner.enabled=False` the plan
    is returned, never refused. The message names the mesh, lists the components and suggests
    flags that fit (or the device count that would)."""
    job = _job(spec)
    remat, micro = bool(spec.model.remat), spec.micro_batch_rows
    capacity = _capacity(spec, capacity_bytes)
    mesh = _mesh(spec, num_devices)
    plan = _plan(job, mesh, remat, micro, capacity, spec.headroom)
    if capacity is None and jax.default_backend() == "cpu":
        return check_host(spec, plan)
    if plan.fits or not spec.refuse:
        return plan
    raise ValueError(_refusal(job, plan, num_devices, remat, micro))


# --- a CPU backend: the plan against the host's memory -------------------------------------------
def host_memory() -> tuple[int, str] | None:
    """(bytes, what set them) this process may use on its host: the smaller of MemTotal and the
    memory limit of its cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`; "max" or the v1
    sentinel near 2**63 mean none); None when neither is readable."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        found.append((kib * 1024, "MemTotal"))
    paths = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if controllers == "":
                paths.append(f"/sys/fs/cgroup{path}/memory.max")
            elif "memory" in controllers.split(","):
                paths.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
    for path in dict.fromkeys(paths):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                limit = int(f.read().strip())  # "max": ValueError, no limit
            if limit < 2**60:
                found.append((limit, f"the cgroup limit, {path}"))
    return min(found) if found else None


def check_host(spec: JobSpec, plan: MemoryPlan, host: tuple[int, str] | None = None) -> MemoryPlan:
    """On a CPU backend the devices are the host: the plan's `cpu_rss` against headroom x the
    host's memory (`host` = (bytes, source), default `host_memory()`; `()`: none), as a GPU plan is
    checked against the device's. Refused (ValueError) before anything loads when it does not fit,
    with the settings that do (`_host_settings`: full fine-tuning ones first, then LoRA, rank
    `HOST_LORA_RANK`, alone and over an NVFP4 base); reported, never refused, with
    `config.planner.enabled=False` or when the host's memory cannot be read."""
    host = host_memory() if host is None else host
    if not host:  # unreadable (or `()`: not checked)
        return plan
    plan = dataclasses.replace(plan, host_memory=int(host[0]), host_source=host[1])
    if plan.fits_host or not spec.refuse:
        return plan
    lines = [
        f"the CPU process does not fit in host memory: an estimated {plan.cpu_rss / GIB:.1f} GiB"
        f" peak RSS > headroom {plan.headroom:g} x {plan.host_memory / GIB:.1f} GiB"
        f" ({plan.host_source}) = {plan.host_budget / GIB:.1f} GiB.",
        plan.table(),
    ]
    full, lora = _host_settings(spec, plan)
    if full:
        lines.append(f"Suggested: {full[0][0]} (est. CPU RSS {full[0][1] / GIB:.1f} GiB)")
        if len(full) > 1:
            also = "; ".join(f"{f} (est. {r / GIB:.1f} GiB)" for f, r in full[1:3])
            lines.append(f"Also fits: {also}")
    if lora:
        what = (
            "with the frozen base packed in NVFP4"
            if spec.lora is not None and spec.lora.enabled
            else "with LoRA (QeRL mode: only the adapters train, a different optimisation)"
        )
        options = "; ".join(f"{f} (est. CPU RSS {r / GIB:.1f} GiB)" for f, r in lora)
        lines.append(f"{'Or' if full else 'Suggested'}, {what}: {options}")
    if not full and not lora:
        lines.append(
            "No smaller micro-batch, rollout copy or LoRA setting fits: use fewer rows"
            " (config.data_batch.prompts, config.rollout.n), bf16 master weights"
            " (config.model.param_dtype=bfloat16: a different optimisation) or a larger host."
        )
    lines.append(
        "(config.model.remat does not help here: XLA:CPU does not honour it; the GPU plan"
        " assumes it does.)"
    )
    raise ValueError("\n".join(lines))


def _lora_variants(spec: JobSpec) -> list[tuple[tuple[str, ...], _Job]]:
    """(flags, job) of QeRL mode's settings: for a full fine-tuning spec, LoRA of rank
    `HOST_LORA_RANK` on every linear, then the same over a packed NVFP4 base; for a LoRA spec over
    an unpacked base, the NVFP4 base. A setting the model's shapes refuse (a rank above a linear's
    width, an input not a multiple of NVFP4's block) is left out."""
    site_of = family_of(spec.model).site_of
    params, _ = _abstract_model(dataclasses.replace(spec.model, remat=False), "lm")
    out = []
    lora, flags = spec.lora, ()
    if lora is None or not lora.enabled:
        lora = dataclasses.replace(lora_lib.OFF, rank=HOST_LORA_RANK)
        try:
            lora_lib.check_ranks(lora, params, site_of)
        except ValueError:
            return []
        flags = (f"--config.lora.rank={HOST_LORA_RANK}",)
        out.append((flags, _job(dataclasses.replace(spec, lora=lora, weight_format="none"))))
    if spec.weight_format == "none":
        try:
            quant_base.check_model(params, "nvfp4", site_of)
        except ValueError:
            return out
        nvfp4 = dataclasses.replace(spec, lora=lora, weight_format="nvfp4")
        out.append((flags + ("--config.model.weight_format=nvfp4",), _job(nvfp4)))
    return out


def _host_settings(
    spec: JobSpec, plan: MemoryPlan
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(flags, estimated CPU RSS) of the settings that fit `plan.host_budget`, as (the full
    fine-tuning ones, the LoRA ones). Full fine-tuning, the least intrusive first: a smaller
    micro-batch (the update's activations; the same step up to rounding), then the compute
    dtype equal to param_dtype (no rollout copy of the params; float32 activations); within
    each, the smallest estimate first. (bf16 master weights, param_dtype=bfloat16, would shrink
    it too, but they change the optimisation: not offered.) LoRA (`_lora_variants`: no AdamW
    moments, gradients or reference of the base; a different optimisation, so listed apart):
    the adapters alone, then over an NVFP4 base, each with the configured micro-batch where it
    fits, else the largest smaller one that does; the NVFP4 base is listed where it is smaller
    or keeps a larger micro-batch."""
    m, job = spec.model, _job(spec)
    variants = [((), job)]
    if m.dtype != m.param_dtype:  # the same params and optimizer state: only these change
        same = dataclasses.replace(m, dtype=m.param_dtype)
        lengths = tuple(b + spec.max_new for b in spec.buckets)
        variants.append(
            (
                (f"--config.model.dtype={m.param_dtype}",),
                dataclasses.replace(
                    job,
                    model=same,
                    rollout_weights=(),
                    kv_cache=_cache_groups(same, spec.rows, lengths, 1),
                    val_kv_cache=_cache_groups(same, spec.val_rows, lengths, spec.val_samplers),
                ),
            )
        )
    full_tiers = len(variants)
    variants += _lora_variants(spec)
    dp = plan.mesh[0] * plan.mesh[1]
    micros = [
        d for d in _divisors(spec.mini_batch_rows) if d % dp == 0 and d <= plan.micro_batch_rows
    ]
    found = []
    for tier, (flags, variant) in enumerate(variants):
        for mb in micros:
            p = dataclasses.replace(
                _plan(variant, plan.mesh, plan.remat, mb, None, plan.headroom),
                host_memory=plan.host_memory,
            )
            if (flags or mb != plan.micro_batch_rows) and p.fits_host:
                more = (
                    ()
                    if mb == plan.micro_batch_rows
                    else (f"--config.actor.micro_batch_rows={mb}",)
                )
                # LoRA: the configured micro-batch first, then the largest smaller one.
                order = -mb if tier >= full_tiers else p.cpu_rss
                found.append((tier, bool(more), order, p.cpu_rss, " ".join(flags + more)))
    found.sort()
    full = [(f, rss) for tier, _, _, rss, f in found if tier < full_tiers]
    lora, last = [], None
    for tier in range(full_tiers, len(variants)):
        best = next((x for x in found if x[0] == tier), None)
        # The NVFP4 base where it is smaller, or keeps a micro-batch the adapters alone do not.
        if best is not None and (last is None or best[3] < last[3] or best[1] < last[1]):
            lora.append((best[4], best[3]))
            last = best
    return full, lora


def _refusal(job: _Job, plan: MemoryPlan, num_devices: int, remat: bool, micro: int) -> str:
    largest = max(COMPONENTS, key=plan.components.get)
    lines = [
        f"{plan.mesh_flag} does not fit in device memory: an estimated"
        f" {plan.total / GIB:.1f} GiB per device > headroom {plan.headroom:g} x"
        f" {plan.capacity / GIB:.1f} GiB = {plan.budget / GIB:.1f} GiB (peak program:"
        f" {plan.peak_phase}; largest component: {largest}"
        f" {plan.components[largest] / GIB:.1f} GiB).",
        plan.table(),
    ]
    found, smallest = _search(job, num_devices, remat, micro, plan.capacity, plan.headroom)
    if found:
        lines.append(f"Suggested: {found[0]}")
        if len(found) > 1:
            lines.append("Also fits: " + "; ".join(str(s) for s in found[1:3]))
        return "\n".join(lines)
    lines.append(
        f"No (data, fsdp, tensor) mesh of {num_devices} devices fits, with or without remat and"
        " smaller micro-batches."
    )
    if smallest is not None:
        biggest = max(COMPONENTS, key=smallest.plan.components.get)
        lines.append(
            f"Smallest estimate on {num_devices} devices: {smallest} (largest component:"
            f" {biggest} {smallest.plan.components[biggest] / GIB:.1f} GiB)."
        )
    # More devices: every data x fsdp that splits the rows and the mini-batch, times every
    # tensor size that splits the model, above num_devices, smallest first.
    counts = sorted(
        {
            dp * tensor
            for dp in _divisors(math.gcd(job.rows, job.mini_batch_rows))
            for tensor in _divisors(_splittable(job.model))
            if dp * tensor > num_devices
        }
    )
    for devices in counts:
        found, _ = _search(job, devices, remat, micro, plan.capacity, plan.headroom)
        if found:
            lines.append(f"It would need {devices} devices: {found[0]}")
            return "\n".join(lines)
    lines.append(
        f"No mesh of any device count fits either: data x fsdp can be at most"
        f" gcd(prompts * n, mini-batch rows) = {math.gcd(job.rows, job.mini_batch_rows)} and"
        f" tensor at most {_splittable(job.model)} here."
    )
    return "\n".join(lines)
