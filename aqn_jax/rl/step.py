"""The RL step as pure functions over a frozen static description.

`static_from(spec.step_spec(config), ...)` builds `Static` once: the hyperparameters (`Hyper`), the
policy and critic modules, the fault plans and the optimizers. The job then jits, with explicit
`NamedSharding`s (`shardings`) and the state donated to the update:

  init_state(static, params, sh)                        -> (RLState, reference params)
  prepare_step(static, state, ref_params, batch, scores, key, values)
                                                        -> (per-row arrays, fault statistics)
  update_step(static, state, batch, key, values)        -> (RLState, metrics)

`prepare_step` computes the old and reference log-probs (and values), the token rewards and the
advantages; between the two the trainer applies the rollout correction
(rl/rollout_correction.py: `is_weights` added to the batch, `rmask` without rejected tokens,
`old_logp` = the sampler's in bypass mode); `update_step` runs the PPO epochs over mini-batches
(lax.scan) with gradient accumulation over micro-batches. `values` are the step's traced
per-step knobs by name (AQN's sigma under `aqn.config.AQN_SIGMA`, a fault's rate ramp): a new
value does not recompile, and a new knob needs no signature change. A batch row is the
left-padded prompt `[bucket]` followed by the `max_new_tokens` response slots; the prompt
length is read from the shapes, so each program compiles once per prompt bucket. Log-probs use
logits / rollout temperature, as the sampler's do (verl), from the response positions only, a
chunk at a time (`policy_logprobs`, `forward.Readout`: never the `[rows, T, V]` logits).

Fault randomness: each forward pass draws its own fault noise (a noisy device never repeats its
error), keyed by the step's 'train' key folded with the pass index; the deterministic faults
(deadzone) are identical in every pass. The critic runs the hardware faults only with
`config.critic.faults=True` (as in the original, where only the actor's matmuls were patched).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from aqn_jax import lora as lora_lib
from aqn_jax import parallel, quant_base
from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.forward import Readout, SharedPrompt, Weights, forward
from aqn_jax.logprobs import check_head_faults
from aqn_jax.lora import LoraSpec
from aqn_jax.models.factory import logical_axes
from aqn_jax.models.registry import ModelConfig, causal_lm, family_of
from aqn_jax.sdc import telemetry, trees
from aqn_jax.sdc.guard import GuardSpec
from aqn_jax.sdc.telemetry import SdcSpec

from . import advantages as adv_lib
from . import losses
from .config import Hyper
from .optim import OptimizerSpec


@flax.struct.dataclass
class RLState:
    """The train state. `params` is what the actor's optimizer trains: the whole policy, or in
    QeRL mode (config.lora.rank > 0) only `{"lora": adapters}` (+ `{"norms": ...}`), with the
    frozen (possibly packed) base in `base`, which checkpoints leave out (`saveable`)."""

    step: jax.Array
    params: Any
    opt_state: Any
    critic_params: Any = None
    critic_opt_state: Any = None
    base: Any = None


def policy_weights(static: Static, state: RLState, trainable=None):
    """What the device reads for the policy: the params, or the base with the adapters."""
    trainable = state.params if trainable is None else trainable
    if not static.lora.enabled:
        return trainable
    return lora_lib.weights(static.lora, state.base, trainable)


def reference_weights(static: Static, state: RLState, ref_params):
    """The reference policy: the frozen copy of full fine-tuning, or in QeRL mode the base with
    the adapters off (no second copy of the weights)."""
    if static.lora.enabled:
        return Weights(state.base, None, None, static.lora.scale) if static.use_ref else None
    return ref_params


def saveable(state: RLState) -> RLState:
    """The state a checkpoint holds: without the frozen base (a LoRA checkpoint holds the
    adapters, their optimizer state and, in its meta, the base's fingerprint)."""
    return state.replace(base=None)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the jitted programs close over, built once (`static_from`)."""

    h: Hyper
    model_cfg: ModelConfig
    policy: nn.Module
    critic: nn.Module
    plan: FaultPlan  # the policy's passes: hardware faults + AQN
    critic_plan: FaultPlan  # the hardware faults with config.critic.faults, else none
    actor_opt: optax.GradientTransformation
    critic_opt: optax.GradientTransformation
    actor_schedule: optax.Schedule
    max_new: int  # response slots of a row (config.rollout.max_new_tokens)
    total_steps: int  # RL steps of the run (the LR and AQN schedules run over them)
    updates: int  # optimizer updates per RL step: ppo_epochs x mini-batches
    sdc: SdcSpec | None = None  # bit faults on trees, the guard's metrics (None: neither)
    lora: LoraSpec = lora_lib.OFF  # config.lora (rank 0: off)
    weight_format: str = "none"  # config.model.weight_format: the frozen base's storage
    share_group: int = 1  # rows per prompt computed once in the passes over rollout rows
    skip: bool = False  # micro-batches of rows without an advantage are not run
    # Why a lever asked for is off, one line each (logged by the train job).
    levers_off: tuple[str, ...] = ()

    @property
    def use_critic(self) -> bool:
        return adv_lib.ESTIMATORS[self.h.estimator].critic

    @property
    def use_ref(self) -> bool:
        return self.h.use_ref

    @property
    def fused_old_logp(self) -> bool:
        """No separate old-log-prob pass: the update's own log-probs, detached, are the PPO
        ratio's old policy (`Hyper.on_policy`, config.actor.old_logp_pass='auto'). The
        bit-fault seams count the prepare pass's flips separately, so SDC keeps the pass."""
        return self.h.on_policy and self.h.old_logp_pass == "auto" and self.sdc is None


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the step programs read of an experiment config (`step_spec`)."""

    h: Hyper
    actor: OptimizerSpec  # config.actor's optimizer
    critic: OptimizerSpec  # config.critic's optimizer
    max_new: int  # config.rollout.max_new_tokens
    critic_faults: bool  # config.critic.faults: the critic runs the hardware faults
    seed: int = 0  # config.seed (the tree faults' keys)
    guard: GuardSpec = GuardSpec()  # config.sdc
    lora: LoraSpec = lora_lib.OFF  # config.lora
    weight_format: str = "none"  # config.model.weight_format


def static_from(
    spec: StepSpec,
    model_cfg: ModelConfig,
    plan: FaultPlan,
    hardware_plan: FaultPlan,
    total_steps: int,
) -> Static:
    h = spec.h
    # Schedules advance per RL step (verl steps its LR scheduler once per update_policy);
    # optax counts optimizer updates, `updates` per RL step.
    updates = h.ppo_epochs * h.mini_batches
    actor_schedule, actor_opt = spec.actor.build(total_steps * updates, updates)
    _, critic_opt = spec.critic.build(total_steps * updates, updates)
    check_head_faults(plan)  # before anything compiles: the readout's chunks at lm_head
    sdc = telemetry.sdc_spec(spec.guard, spec.actor.grad_clip, plan, total_steps * updates)
    if sdc is not None:  # bit faults on the gradients / AdamW moments: around the optimizer
        actor_opt = trees.with_tree_faults(actor_opt, sdc.gradient, sdc.moments, spec.seed)
    share_group, skip, off = levers(h, plan, hardware_plan if spec.critic_faults else None, sdc)
    return Static(
        h=h,
        model_cfg=model_cfg,
        policy=causal_lm(model_cfg),
        critic=causal_lm(model_cfg, head="value"),
        plan=plan,
        critic_plan=hardware_plan if spec.critic_faults else FaultPlan(),
        actor_opt=actor_opt,
        critic_opt=critic_opt,
        actor_schedule=actor_schedule,
        max_new=spec.max_new,
        total_steps=int(total_steps),
        updates=updates,
        sdc=sdc,
        lora=spec.lora,
        weight_format=spec.weight_format,
        share_group=share_group,
        skip=skip,
        levers_off=tuple(off),
    )


def share_refusals(plan: FaultPlan, critic_plan: FaultPlan | None = None, sdc=None) -> list[str]:
    """Why the update's passes would change with a shared prompt (empty: they would not)."""
    why = plan.split_refusals("train", split=True)
    if critic_plan is not None:
        why += critic_plan.split_refusals("train", split=True)
    if sdc is not None:
        why.append("config.sdc counts the faults of each pass's calls")
    return why


def levers(h: Hyper, plan: FaultPlan, critic_plan: FaultPlan | None, sdc) -> tuple:
    """(rows per shared prompt, the skip on, why a lever asked for is off). A micro-batch of m
    rows holds whole blocks of gcd(m, n) rows of one group: each block's prompt runs once."""
    off = []
    group = 1
    if h.share_prompt:
        why = share_refusals(plan, critic_plan, sdc)
        rows = h.micro_rows
        group = math.gcd(rows, h.n) if not why else 1
        if why:
            off += [f"config.actor.share_prompt off: {w}" for w in why]
        elif group == 1:
            off.append(
                f"config.actor.share_prompt off: a micro-batch of {rows} rows holds no two rows"
                f" of one group of n={h.n}"
            )
    skip = False
    if h.skip_zero_advantage:
        critic = adv_lib.ESTIMATORS[h.estimator].critic
        why = h.skip_refusals(critic)
        if sdc is not None:
            why.append("config.sdc counts every micro-batch's faults")
        off += [f"config.actor.skip_zero_advantage off: {w}" for w in why]
        skip = not why
    return group, skip, off


# -- shardings and the initial state ---------------------------------------------------------------
class Shardings(NamedTuple):
    state: RLState  # of NamedShardings: params and moments by logical axes, counters replicated
    params: Any  # the trained params (the whole policy, and the reference; or the adapters)
    rows: NamedSharding  # [rows, T] arrays: rows over ('data', 'fsdp')
    scores: NamedSharding  # [rows]
    replicated: NamedSharding
    policy: Any = None  # of what `policy_weights` returns (the params, or base + adapters)


def init_critic(model_cfg: ModelConfig, policy_params):
    """The critic: the policy's backbone (embed, layers, final norm) and a fresh value head
    (zero-initialised: every value starts at 0)."""
    backbone = {k: v for k, v in policy_params.items() if k != "lm_head"}
    D = model_cfg.hidden_size
    head = {"kernel": np.zeros((D, 1), np.float32), "bias": np.zeros((1,), np.float32)}
    return {**jax.tree_util.tree_map(np.array, backbone), "value_head": head}


def _fresh_state(static: Static, params, critic_params, base) -> RLState:
    return RLState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=static.actor_opt.init(params),
        critic_params=critic_params,
        critic_opt_state=None if critic_params is None else static.critic_opt.init(critic_params),
        base=base,
    )


def _site_of(static: Static):
    return family_of(static.model_cfg).site_of


def trainable_shapes(static: Static, base_shapes):
    """The trained tree's shapes (`jax.eval_shape`): the params, or the adapters (+ norms)."""
    if not static.lora.enabled:
        return base_shapes
    return jax.eval_shape(
        lambda: lora_lib.init_trainable(
            static.lora, base_shapes, _site_of(static), jax.random.key(0)
        )
    )


def shardings(static: Static, mesh: Mesh) -> Shardings:
    """Shape-first (`jax.eval_shape`): the state's shardings without allocating it."""
    rep = parallel.replicated(mesh)
    full = parallel.param_shardings(logical_axes(static.model_cfg), mesh)
    params, base, policy = full, None, full
    if static.lora.enabled:
        axes = logical_axes(static.model_cfg)
        packed = quant_base.packed_axes(
            axes, static.weight_format, _site_of(static), static.model_cfg.param_dtype
        )
        base = parallel.param_shardings(packed, mesh)
        params = parallel.param_shardings(
            lora_lib.trainable_axes(static.lora, axes, _site_of(static)), mesh
        )
        policy = Weights(base, params["lora"], params.get("norms"), static.lora.scale)
    critic = None
    if static.use_critic:
        critic = parallel.param_shardings(logical_axes(static.model_cfg, head="value"), mesh)

    def abstract(shards):  # where an optimizer's state holds params needs no param shapes
        return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((), jnp.float32), shards)

    def opt_sharding(opt, shards):
        # Moments follow their params; counters and other scalars are replicated.
        return optax.tree_map_params(
            opt,
            lambda _, s: s,
            jax.eval_shape(opt.init, abstract(shards)),
            shards,
            transform_non_params=lambda _: rep,
        )

    state = RLState(
        step=rep,
        params=params,
        opt_state=opt_sharding(static.actor_opt, params),
        critic_params=critic,
        critic_opt_state=None if critic is None else opt_sharding(static.critic_opt, critic),
        base=base,
    )
    return Shardings(
        state=state,
        params=params,
        rows=parallel.batch_sharding(mesh, 2),
        scores=parallel.batch_sharding(mesh, 1),
        replicated=rep,
        policy=policy,
    )


def init_state(
    static: Static, params, sh: Shardings, lora_key: jax.Array | None = None
) -> tuple[RLState, Any]:
    """(the initial train state, the frozen reference params or None) from host `params`,
    placed with `sh`. The state aliases the placed params (the update then donates them).

    QeRL mode: `params` is the frozen base (its decoder kernels packed when
    config.model.weight_format is set), the trained params are fresh adapters (A from
    `lora_key`, B zero) and the reference is the base itself (None is returned)."""
    # Host values in, global arrays out: every process holds only its own shards.
    host_params = jax.device_get(params)
    base = None
    if static.lora.enabled:
        base = parallel.put_global(host_params, sh.state.base)
        key = jax.random.key(0) if lora_key is None else lora_key
        host_params = jax.device_get(
            lora_lib.init_trainable(static.lora, host_params, _site_of(static), key)
        )
    params = parallel.put_global(host_params, sh.params)
    critic_params = None
    if static.use_critic:
        critic_params = parallel.put_global(
            init_critic(static.model_cfg, jax.device_get(quant_base.dequantize(base or params))),
            sh.state.critic_params,
        )
    ref_params = None
    if static.use_ref and not static.lora.enabled:
        ref_params = jax.tree_util.tree_map(jnp.copy, params)
    init = jax.jit(lambda p, cp, b: _fresh_state(static, p, cp, b), out_shardings=sh.state)
    return init(params, critic_params, base), ref_params


# -- the forward passes ----------------------------------------------------------------------------
def response_logits(logits_BSV, prompt_len: int, resp_len: int):
    """The outputs (the critic's values) at the positions that predict response token t:
    prompt_len - 1 + t."""
    return logits_BSV[:, prompt_len - 1 : prompt_len - 1 + resp_len]


def policy_logprobs(static: Static, params, batch, key, values):
    """((log-probs, entropy) of the response tokens `[rows, max_new]` under logits /
    temperature, the pass's fault statistics): the head only on the response positions, a chunk
    at a time (`forward.Readout`), never the `[rows, T, V]` logits."""
    plen = batch["ids"].shape[1] - static.max_new
    return forward(
        static.policy,
        params,
        batch["ids"],
        batch["mask"],
        plan=static.plan,
        phase="train",
        key=key,
        values=values,
        mutable=["fault_stats"],
        readout=Readout(batch["tokens"], plen - 1, static.h.temperature),
        share=_share(static),
    )


def _share(static: Static) -> SharedPrompt | None:
    """The passes' shared prompt (config.actor.share_prompt), None when it is off."""
    if static.share_group == 1:
        return None
    return SharedPrompt(static.share_group, static.max_new)


def _values(static: Static, critic_params, batch, key, values):
    plen = batch["ids"].shape[1] - static.max_new
    share = _share(static)
    v = forward(
        static.critic,
        critic_params,
        batch["ids"],
        batch["mask"],
        plan=static.critic_plan,
        phase="train",
        key=key,
        values=values,
        share=share,
    )
    if share is not None:  # already the response's positions
        return v
    return response_logits(v[..., None], plen, static.max_new)[..., 0]


# -- prepare: old / reference log-probs, values, rewards, advantages -------------------------------
def _prepare_chunk(static: Static, state: RLState, ref_params, key, values, xs):
    j, mic = xs
    o = {"fault_stats": {}}
    if not static.fused_old_logp:  # else the update's own log-probs are the old ones
        (logp, ent), fstate = policy_logprobs(
            static, policy_weights(static, state), mic, jax.random.fold_in(key, 3 * j), values
        )
        o = {"old_logp": logp, "entropy": ent, "fault_stats": fstate.get("fault_stats", {})}
    if ref_params is not None:
        (o["ref_logp"], _), _ = policy_logprobs(
            static, ref_params, mic, jax.random.fold_in(key, 3 * j + 1), values
        )
    if static.use_critic:
        o["values"] = _values(
            static, state.critic_params, mic, jax.random.fold_in(key, 3 * j + 2), values
        )
    return o


def prepare_step(static: Static, state: RLState, ref_params, batch, scores, key, values):
    """(per-row arrays, fault statistics): old and reference log-probs (and values), token
    rewards and advantages, then the train pass's fault statistics (means over the chunks).

    The forward passes run over the update's micro-batches (`lax.map`, micro_batch_rows
    rows each, the same rows the update will group): the memory of one micro-batch, not
    of the whole batch, and a tensor-wide fault statistic (a deadzone's amax) sees the
    same rows here as in the update, so the first PPO ratio compares like with like.

    With `static.fused_old_logp` the policy's pass is left out (no `old_logp`, `entropy` or
    fault statistics here: the update returns them); what remains is the reference's and the
    critic's passes, if any, and the advantages."""
    h = static.h
    rows = batch["ids"].shape[0]
    C = h.mini_batches * h.micro_batches
    mics = {
        k: batch[k].reshape(C, rows // C, *batch[k].shape[1:])
        for k in ("ids", "mask", "tokens", "rmask")
    }
    ref_params = reference_weights(static, state, ref_params)
    outs = {"fault_stats": {}}
    if not static.fused_old_logp or ref_params is not None or static.use_critic:
        outs = jax.lax.map(
            lambda xs: _prepare_chunk(static, state, ref_params, key, values, xs),
            (jnp.arange(C), mics),
        )
    stats = jax.tree_util.tree_map(lambda v: jnp.mean(v, axis=0), outs.pop("fault_stats"))
    out = {k: v.reshape(rows, *v.shape[2:]) for k, v in outs.items()}
    mask = batch["rmask"]
    kl = None
    if h.use_kl_in_reward:  # never fused (Hyper.on_policy): the old log-probs are here
        kl = losses.kl_penalty(out["old_logp"], out["ref_logp"], h.kl_type)
    rewards = adv_lib.token_level_rewards(
        scores, mask, kl if h.use_kl_in_reward else None, h.kl_coef
    )
    out["token_rewards"] = rewards
    estimate = adv_lib.ESTIMATORS[h.estimator].estimate
    out["advantages"], returns = estimate(rewards, out.get("values"), mask, h)
    if returns is not None:
        out["returns"] = returns
    out["live"] = live_rows(h, rewards)
    return out, stats


def live_rows(h: Hyper, rewards_NT) -> jax.Array:
    """[rows, 1] 1.0 where a row's group has a signal: for a grouped estimator, not all of its
    rewards (the outcome estimator's input) are equal (`advantages.silent_groups`); else 1."""
    rows = rewards_NT.shape[0]
    if not adv_lib.ESTIMATORS[h.estimator].grouped:
        return jnp.ones((rows, 1), jnp.float32)
    silent = adv_lib.silent_groups(jnp.sum(rewards_NT, axis=1), h.n)
    return jnp.repeat(~silent, h.n).astype(jnp.float32)[:, None]


# -- update: PPO epochs over mini-batches, accumulation over micro-batches -------------------------
def actor_loss(static: Static, params, mic, denom, key, values):
    """Policy loss (config.algo.policy_loss) - entropy bonus (+ KL loss) of one micro-batch."""
    h = static.h
    (logp, entropy), fstate = policy_logprobs(static, params, mic, key, values)
    mask = mic["rmask"]
    # On-policy (static.fused_old_logp): the old policy is this pass's, detached: ratio 1.
    old_logp = jax.lax.stop_gradient(logp) if static.fused_old_logp else mic["old_logp"]
    pg, aux = h.policy_loss(
        logp,
        old_logp,
        mic["advantages"],
        mask,
        agg=h.agg,
        denom=denom,
        weights_NT=mic.get("is_weights"),  # the rollout correction's IS weights, when on
    )
    ent = losses.agg_loss(entropy, mask, h.agg, denom)
    loss = pg - h.entropy_coeff * ent
    kl_loss = jnp.zeros(())
    if h.use_kl_loss:
        kl_loss = losses.agg_loss(
            losses.kl_penalty(logp, mic["ref_logp"], h.kl_type), mask, h.agg, denom
        )
        loss = loss + h.kl_loss_coef * kl_loss
    # This pass's flips and ABFT detections (none without SDC at module sites).
    aux = {**aux, **telemetry.loss_counts(static.sdc, fstate.get("fault_stats", {}))}
    aux = {"pg_loss": pg, "kl_loss": kl_loss, "entropy": ent, **aux}
    if static.fused_old_logp:  # what the left-out pass gave: per row, and the fault stats
        aux[ROWS] = {"old_logp": old_logp}
        aux[FAULT_STATS] = jax.tree_util.tree_map(
            lambda v: jnp.asarray(v, jnp.float32), fstate.get("fault_stats", {})
        )
    return loss, aux


def critic_loss(static: Static, cparams, mic, denom, key, values):
    """Clipped value loss of one micro-batch."""
    h = static.h
    v = _values(static, cparams, mic, key, values)
    loss, aux = losses.value_loss(
        v,
        mic["values"],
        mic["returns"],
        mic["rmask"],
        clip=h.vf_clip,
        agg=h.agg,
        denom=denom,
    )
    return loss, {"vf_loss": loss, **aux, "vpred_mean": adv_lib.masked_mean(v, mic["rmask"])}


ROWS = "_rows"  # a loss's per-row outputs (kept per micro-batch, not averaged)
FAULT_STATS = "_fault_stats"  # the fused pass's fault statistics (averaged as prepare's are)


def accumulate(loss_fn, params, mb, denom, base, live_micros=None):
    """(summed gradient, mean metrics) of `loss_fn(params, micro-batch, denom, key)` over the
    micro-batches of `mb` (leading axis), the j-th keyed by fold_in(base, j). A metric under
    `ROWS` is per row: it comes back stacked, [micro-batches, rows, ...].

    `live_micros` (traced): only the first that many micro-batches run (`lax.cond`); the others
    hold rows without an advantage (`_live_first`), whose gradient and loss are exactly 0: they
    add 0 to the sums, NaN rows under `ROWS`, and `FAULT_STATS` averages the ones that ran."""
    G = jax.tree_util.tree_leaves(mb)[0].shape[0]

    def run(j, mic):
        (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(
            params, mic, denom, jax.random.fold_in(base, j)
        )
        return g, m

    def micro(carry, xs):
        grads, mets = carry
        j, mic = xs
        if live_micros is None:
            g, m = run(j, mic)
        else:
            shapes = jax.eval_shape(run, j, mic)
            fill = {ROWS: jnp.nan}

            def skipped():
                zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])
                m = {
                    k: jax.tree_util.tree_map(
                        lambda x, k=k: jnp.full(x.shape, fill.get(k, 0), x.dtype), v
                    )
                    for k, v in shapes[1].items()
                }
                return zeros, m

            g, m = jax.lax.cond(j < live_micros, lambda: run(j, mic), skipped)
        rows = m.pop(ROWS, {})
        grads = jax.tree_util.tree_map(jnp.add, grads, g)
        mets = jax.tree_util.tree_map(lambda a, b: a + b / G, mets, m)
        return (grads, mets), rows

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    mic0 = jax.tree_util.tree_map(lambda x: x[0], mb)
    shapes = jax.eval_shape(lambda: loss_fn(params, mic0, denom, base)[1])
    shapes.pop(ROWS, None)
    mets0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, mets), rows = jax.lax.scan(micro, (zeros, mets0), (jnp.arange(G), mb))
    if rows:
        mets[ROWS] = rows
    if live_micros is not None and FAULT_STATS in mets:
        ran = jnp.maximum(live_micros, 1).astype(jnp.float32)
        mets[FAULT_STATS] = jax.tree_util.tree_map(lambda v: v * G / ran, mets[FAULT_STATS])
    return grads, mets


def mini_batches(static: Static, batch):
    """The batch as [mini-batches, micro-batches, rows, ...]."""
    M, G = static.h.mini_batches, static.h.micro_batches
    return {k: v.reshape(M, G, v.shape[0] // (M * G), *v.shape[1:]) for k, v in batch.items()}


def minibatch_grads(static: Static, params, mb, key, idx, values, frozen=None, live_micros=None):
    """(actor gradient, its metrics, the loss denominator) of mini-batch `mb`, the `idx`-th
    update of the step: what `update_step` feeds the actor's optimizer. `params` are the
    trained ones; in QeRL mode the adapters over the `frozen` base (no gradient reaches it)."""
    h = static.h
    denom = losses.agg_denominator(mb["rmask"].reshape(-1, mb["rmask"].shape[-1]), h.agg)
    base = jax.random.fold_in(key, 10 + idx)

    def loss(p, mic, d, k):
        weights = lora_lib.weights(static.lora, frozen, p) if static.lora.enabled else p
        return actor_loss(static, weights, mic, d, k, values)

    if static.sdc is not None and static.sdc.abft_backward:  # the rows backward ABFT flags too
        layers = static.model_cfg.num_hidden_layers
        grads, mets = telemetry.abft_accumulate(accumulate, layers, loss, params, mb, denom, base)
    else:
        grads, mets = accumulate(loss, params, mb, denom, base, live_micros)
    return grads, mets, denom


def _live_first(static: Static, batch):
    """(the batch with each mini-batch's rows that have a signal (`batch['live']`) first, the
    order taken from the batch's rows, the micro-batches per mini-batch that hold any of them).
    A stable sort by a key constant over each group keeps a group's rows together, in order
    and on their block boundaries (the shared prompt's blocks)."""
    h = static.h
    M = h.mini_batches
    rows = batch["ids"].shape[0]
    r = rows // M
    live = batch["live"][:, 0].reshape(M, r)
    perm = jnp.argsort(1.0 - live, axis=1, stable=True)
    order = (perm + (jnp.arange(M) * r)[:, None]).reshape(-1)
    m = r // h.micro_batches
    micros = (jnp.sum(live, axis=1).astype(jnp.int32) + m - 1) // m
    return {k: v[order] for k, v in batch.items()}, order, micros


def _minibatch_update(static: Static, key, values, mbatch, st: RLState, idx, live_micros=None):
    h = static.h
    mb = jax.tree_util.tree_map(lambda x: x[idx % h.mini_batches], mbatch)
    n_live = None if live_micros is None else live_micros[idx % h.mini_batches]
    mets = {}
    cparams, copt = st.critic_params, st.critic_opt_state
    if static.use_critic:
        denom = losses.agg_denominator(mb["rmask"].reshape(-1, mb["rmask"].shape[-1]), h.agg)
        base = jax.random.fold_in(key, 10 + idx)

        def closs(p, mic, d, k):
            return critic_loss(static, p, mic, d, k, values)

        cg, cm = accumulate(closs, cparams, mb, denom, jax.random.fold_in(base, 1 << 20))
        cu, copt = static.critic_opt.update(cg, copt, cparams)
        cparams = optax.apply_updates(cparams, cu)
        mets.update({f"critic/{k}": v for k, v in cm.items()})
        mets["critic/grad_norm"] = optax.tree.norm(cg)
    g, am, _ = minibatch_grads(static, st.params, mb, key, idx, values, st.base, n_live)
    grad_norm = optax.tree.norm(g)
    # No actor update during the critic warm-up (verl critic_warmup).
    live = st.step >= h.critic_warmup if static.use_critic else jnp.bool_(True)
    if n_live is not None:  # no row with a signal: no optimizer step (AdamW would still move)
        live = live & (n_live > 0)
    trees_on = static.sdc is not None and static.sdc.trees
    extra = {"values": values} if trees_on else {}  # the RL step and attempt key the faults
    u, opt = static.actor_opt.update(g, st.opt_state, st.params, **extra)
    params = jax.tree_util.tree_map(
        lambda p, q: jnp.where(live, q, p), st.params, optax.apply_updates(st.params, u)
    )
    opt = jax.tree_util.tree_map(lambda a, b: jnp.where(live, b, a), st.opt_state, opt)
    for k in (ROWS, FAULT_STATS):  # the fused old-log-prob pass's outputs, not metrics
        if k in am:
            mets[k] = am.pop(k)
    mets.update({f"actor/{k}": v for k, v in am.items()})
    mets["actor/grad_norm"] = grad_norm
    if trees_on and static.sdc.gradient:  # the norm after the gradient faults (the guard's)
        mets["sdc/grad_norm"] = trees.faulty_grad_norm(opt)
    st = st.replace(params=params, opt_state=opt, critic_params=cparams, critic_opt_state=copt)
    return st, mets


OLD_LOGP = "_old_logp"  # update_step's output with static.fused_old_logp: [rows, T]


def update_step(static: Static, state: RLState, batch, key, values) -> tuple[RLState, dict]:
    """PPO epochs over mini-batches (lax.scan), gradient accumulation over micro-batches;
    returns the next state and the step's metrics (means over the updates). With
    `static.fused_old_logp` the metrics also hold what prepare left out: the old log-probs
    under `OLD_LOGP` ([rows, T]) and the train pass's fault statistics under `FAULT_STATS`."""
    h = static.h
    rows = batch["ids"].shape[0]
    order = live_micros = None
    if static.skip:  # rows without an advantage last; their micro-batches are not run
        batch, order, live_micros = _live_first(static, batch)
    elif "live" in batch:
        batch = {k: v for k, v in batch.items() if k != "live"}
    mbatch = mini_batches(static, batch)
    before = state
    state, mets = jax.lax.scan(
        lambda st, idx: _minibatch_update(static, key, values, mbatch, st, idx, live_micros),
        state,
        jnp.arange(h.ppo_epochs * h.mini_batches),
    )
    fused = {k: mets.pop(k) for k in (ROWS, FAULT_STATS) if k in mets}
    mets = jax.tree_util.tree_map(jnp.mean, mets)
    if static.skip:
        live = batch["live"]
        mets["actor/rows_updated"] = jnp.sum(live)
        mets["actor/update_skipped"] = (jnp.sum(live) == 0).astype(jnp.float32)
    if fused:  # one update (Hyper.on_policy): its rows in batch order, its stats as prepare's
        old = fused[ROWS]["old_logp"].reshape(rows, -1)
        if order is not None:  # back to the batch's order; NaN on the rows not run
            old = jnp.zeros_like(old).at[order].set(old)
        mets[OLD_LOGP] = old
        mets[FAULT_STATS] = jax.tree_util.tree_map(lambda v: v[0], fused[FAULT_STATS])
    if static.sdc is not None:
        sdc = telemetry.update_metrics(
            static.sdc, static.updates, h.micro_batches, before, state, mets
        )
        mets.update(sdc)
    mets["actor/lr"] = jnp.asarray(static.actor_schedule(state.step * static.updates), jnp.float32)
    return state.replace(step=state.step + 1), mets
