"""The RL loop: GRPO (and Dr.GRPO) or PPO with a critic (GAE), on the faulty device.

One step (DESIGN.md's data path):

  prompts -> rollout (phase `rollout`: hardware faults + AQN at this step's sigma)
          -> rewards (verl GSM8K scorer) -> old / reference log-probs and values (phase `train`)
          -> advantages (GRPO group z-score or GAE) -> PPO epochs over mini-batches
             (clipped + dual-clip policy loss, KL loss, entropy bonus; clipped value loss)
          -> metrics (verl names), validation every `val_every` steps.

Shapes are fixed per prompt bucket: a training row is the left-padded prompt `[bucket]`
followed by the `max_new_tokens` response slots, so the prepare and update programs compile
once per bucket. Log-probs use logits / rollout temperature, as the sampler's do (verl).

Fault randomness: each forward pass of the trainer draws its own fault noise (a noisy device
never repeats its error), keyed by (seed, step, 'train') folded with the pass index; the
deterministic faults (deadzone) are identical in every pass. The critic runs the hardware
faults only with `config.critic.faults=True` (as in the original, where only the actor's
matmuls were patched).

Parallelism: the update and prepare programs are jitted once with explicit shardings (params
and optimizer state by logical axes, batch rows over ('data', 'fsdp')) and donate the state.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from aqn_jax import parallel
from aqn_jax.data.gsm8k import Example, PromptBatcher
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.faults.config import AQN_SIGMA, aqn_sigma
from aqn_jax.faults.intercept import FaultPlan, step_key, summarize_stats
from aqn_jax.models.factory import logical_axes
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from aqn_jax.rewards import score_batch

from . import advantages as adv_lib
from . import losses
from .optim import optimizer_of
from .sampler import Sampler, SamplingParams


@flax.struct.dataclass
class RLState:
    step: jax.Array
    params: Any
    opt_state: Any
    critic_params: Any = None
    critic_opt_state: Any = None


@dataclasses.dataclass(frozen=True)
class Hyper:
    """The static settings of the jitted programs (from config.algo / actor / critic)."""

    estimator: str
    n: int
    temperature: float
    clip_low: float
    clip_high: float
    clip_ratio_c: float
    agg: str
    use_kl_loss: bool
    kl_loss_coef: float
    kl_type: str
    use_kl_in_reward: bool
    kl_coef: float
    entropy_coeff: float
    gamma: float
    lam: float
    ppo_epochs: int
    mini_batches: int
    micro_batches: int
    vf_clip: float
    critic_warmup: int


def hyper_from(config) -> Hyper:
    algo, actor = config.algo, config.actor
    for field, value in (
        ("data_batch.prompts", config.data_batch.prompts),
        ("rollout.n", config.rollout.n),
        ("actor.ppo_epochs", actor.ppo_epochs),
        ("actor.mini_batch_prompts", actor.mini_batch_prompts),
        ("actor.micro_batch_rows", actor.micro_batch_rows),
    ):
        if value < 1:
            raise ValueError(f"config.{field}={value}; must be a positive int")
    if algo.estimator not in adv_lib.ESTIMATORS:
        raise ValueError(f"config.algo.estimator={algo.estimator!r}; allowed: {adv_lib.ESTIMATORS}")
    if algo.estimator in ("grpo", "drgrpo") and int(config.rollout.n) < 2:
        raise ValueError(
            f"config.rollout.n={config.rollout.n}; must be >= 2 with"
            f" config.algo.estimator={algo.estimator!r} (its advantage compares the n samples of"
            " a prompt; n=1 needs estimator 'gae')"
        )
    prompts = int(config.data_batch.prompts)
    if prompts % int(actor.mini_batch_prompts):
        raise ValueError(
            f"config.actor.mini_batch_prompts={actor.mini_batch_prompts} must divide"
            f" config.data_batch.prompts={prompts}"
        )
    rows = int(actor.mini_batch_prompts) * int(config.rollout.n)
    if rows % int(actor.micro_batch_rows):
        raise ValueError(
            f"config.actor.micro_batch_rows={actor.micro_batch_rows} must divide the mini-batch"
            f" rows mini_batch_prompts*n = {rows}"
        )
    if algo.loss_agg_mode not in losses.AGG_MODES:
        raise ValueError(
            f"config.algo.loss_agg_mode={algo.loss_agg_mode!r}; allowed: {losses.AGG_MODES}"
        )
    if algo.kl_type not in losses.KL_TYPES:
        raise ValueError(f"config.algo.kl_type={algo.kl_type!r}; allowed: {losses.KL_TYPES}")
    return Hyper(
        estimator=algo.estimator,
        n=int(config.rollout.n),
        temperature=float(config.rollout.temperature) or 1.0,
        clip_low=float(algo.clip_ratio_low),
        clip_high=float(algo.clip_ratio_high),
        clip_ratio_c=float(algo.clip_ratio_c),
        agg=algo.loss_agg_mode,
        use_kl_loss=bool(algo.use_kl_loss),
        kl_loss_coef=float(algo.kl_loss_coef),
        kl_type=algo.kl_type,
        use_kl_in_reward=bool(algo.use_kl_in_reward),
        kl_coef=float(algo.kl_coef),
        entropy_coeff=float(algo.entropy_coeff),
        gamma=float(algo.gamma),
        lam=float(algo.lam),
        ppo_epochs=int(actor.ppo_epochs),
        mini_batches=prompts // int(actor.mini_batch_prompts),
        micro_batches=rows // int(actor.micro_batch_rows),
        vf_clip=float(config.critic.cliprange_value),
        critic_warmup=int(config.critic.warmup_steps),
    )


def response_logits(logits_BSV, prompt_len: int, resp_len: int):
    """Logits that predict response token t: position prompt_len - 1 + t."""
    return logits_BSV[:, prompt_len - 1 : prompt_len - 1 + resp_len]


def token_logprobs(logits_NTV, tokens_NT, temperature: float):
    logp = jax.nn.log_softmax(logits_NTV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens_NT[..., None], axis=-1)[..., 0]


class Trainer:
    """Owns the models, the jitted programs, the samplers and the state of one RL run.

    The update donates the train state: pass `params` the Trainer may own (device arrays
    already placed with these shardings are consumed by the first step; pass host arrays to
    keep a copy)."""

    def __init__(
        self,
        config,
        model_config: Qwen2Config,
        params: Any,
        tokenizer: Tokenizer,
        train_examples: Sequence[Example],
        test_examples: Sequence[Example],
        plan: FaultPlan,
        hardware_plan: FaultPlan,
        mesh: jax.sharding.Mesh,
        total_steps: int | None = None,
    ):
        self.config = config
        self.h = hyper_from(config)
        self.mc = model_config
        self.tokenizer = tokenizer
        self.plan = plan
        self.hw_plan = hardware_plan
        self.critic_plan = hardware_plan if config.critic.faults else FaultPlan()
        self.mesh = mesh
        self.seed = int(config.seed)
        self.policy = Qwen2ForCausalLM(model_config)
        self.critic = Qwen2ForCausalLM(model_config, head="value")
        self.use_critic = self.h.estimator == "gae"
        self.use_ref = self.h.use_kl_loss or self.h.use_kl_in_reward

        ro = config.rollout
        self.max_new = int(ro.max_new_tokens)
        self.buckets = tuple(int(b) for b in ro.prompt_buckets)
        self.batcher = PromptBatcher(
            train_examples,
            tokenizer,
            int(config.data_batch.prompts),
            self.seed,
            max_prompt_len=int(ro.max_prompt_len),
            buckets=self.buckets,
            drop_long=True,
        )
        self.test_examples = list(test_examples)
        # None: config.trainer.total_epochs passes over the (length-filtered) train split.
        if total_steps is None:
            total_steps = total_steps_of(config, self.batcher.batches_per_epoch)
        self.total_steps = int(total_steps)
        vocab = tokenizer.vocab_size
        self.sample_params = SamplingParams(
            max_new_tokens=self.max_new,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            temperature=float(ro.temperature),
            top_k=int(ro.top_k),
            top_p=float(ro.top_p),
            n=self.h.n,
            vocab_size=vocab,
        )
        greedy = dataclasses.replace(self.sample_params, temperature=0.0, top_k=0, top_p=1.0, n=1)
        # Generation has no backward pass: the samplers' model does not remat.
        gen = Qwen2ForCausalLM(dataclasses.replace(model_config, remat=False))
        self.rollout_sampler = Sampler(gen, self.sample_params, plan, self.buckets, mesh=mesh)
        self.clean_sampler = Sampler(
            gen, greedy, FaultPlan(), self.buckets, phase="eval", mesh=mesh
        )
        # On a clean device both validations are the same program: compile it once.
        self.val_sampler = (
            Sampler(gen, greedy, hardware_plan, self.buckets, phase="eval", mesh=mesh)
            if hardware_plan.active("eval")
            else self.clean_sampler
        )

        # -- optimizers and sharded state --------------------------------------------------
        # Schedules advance per RL step (verl steps its LR scheduler once per update_policy);
        # optax counts optimizer updates, `updates` per RL step.
        self.updates = self.h.ppo_epochs * self.h.mini_batches
        U = self.updates
        self.actor_schedule, self.actor_opt = optimizer_of(
            config.actor, "warmup_steps", self.total_steps * U, U, "config.actor"
        )
        _, self.critic_opt = optimizer_of(
            config.critic, "lr_warmup_steps", self.total_steps * U, U, "config.critic"
        )
        axes = logical_axes(model_config)
        self.param_sharding = parallel.param_shardings(axes, mesh)
        rep = parallel.replicated(mesh)
        # Host values in, global arrays out: every process holds only its own shards.
        host_params = jax.device_get(params)
        params = parallel.put_global(host_params, self.param_sharding)
        critic_params = critic_sharding = None
        if self.use_critic:
            critic_sharding = parallel.param_shardings(
                logical_axes(model_config, head="value"), mesh
            )
            critic_params = parallel.put_global(
                init_critic(model_config, host_params), critic_sharding
            )
        self.critic_sharding = critic_sharding
        self.ref_params = jax.tree_util.tree_map(jnp.copy, params) if self.use_ref else None

        def opt_sharding(opt, p, shardings):
            # Moments follow their params; counters and other scalars are replicated.
            return optax.tree_map_params(
                opt,
                lambda _, s: s,
                jax.eval_shape(opt.init, p),
                shardings,
                transform_non_params=lambda _: rep,
            )

        self.state_sharding = RLState(
            step=rep,
            params=self.param_sharding,
            opt_state=opt_sharding(self.actor_opt, params, self.param_sharding),
            critic_params=critic_sharding,
            critic_opt_state=None
            if critic_params is None
            else opt_sharding(self.critic_opt, critic_params, critic_sharding),
        )

        def init_state(p, cp):
            return RLState(
                step=jnp.zeros((), jnp.int32),
                params=p,
                opt_state=self.actor_opt.init(p),
                critic_params=cp,
                critic_opt_state=None if cp is None else self.critic_opt.init(cp),
            )

        self.state = jax.jit(init_state, out_shardings=self.state_sharding)(params, critic_params)
        # bf16 compute with fp32 master weights: the update keeps the fp32 params (each matmul
        # casts its kernel); generation gets one bf16 copy per step (the inference engine's
        # weights), which equals what every traced cast produces.
        self._cast = None
        if jnp.dtype(model_config.dtype) != jnp.dtype(model_config.param_dtype):
            dt = jnp.dtype(model_config.dtype)
            self._cast = jax.jit(
                lambda p: jax.tree_util.tree_map(lambda x: x.astype(dt), p),
                out_shardings=self.param_sharding,
            )
        self._prepare = jax.jit(self._prepare_fn, static_argnums=(6,))
        self._update = jax.jit(
            self._update_fn,
            static_argnums=(4,),
            donate_argnums=(0,),
            out_shardings=(self.state_sharding, parallel.replicated(mesh)),
        )

    # -- the jitted programs ---------------------------------------------------------------------
    def _policy_logits(self, params, plan, batch, plen, key, values):
        with plan.apply("train", key=key, values=values):
            logits, state = self.policy.apply(
                {"params": params},
                batch["ids"],
                attention_mask=batch["mask"],
                mutable=["fault_stats"],
            )
        return response_logits(logits, plen, self.max_new), state

    def _values(self, critic_params, batch, plen, key, values):
        with self.critic_plan.apply("train", key=key, values=values):
            v = self.critic.apply(
                {"params": critic_params}, batch["ids"], attention_mask=batch["mask"]
            )
        return response_logits(v[..., None], plen, self.max_new)[..., 0]

    def _prepare_fn(self, state: RLState, ref_params, batch, scores, key, values, plen):
        """Old and reference log-probs (and values), token rewards and advantages.

        The forward passes run over the update's micro-batches (`lax.map`, micro_batch_rows
        rows each, the same rows the update will group): the memory of one micro-batch, not
        of the whole batch, and a tensor-wide fault statistic (a deadzone's amax) sees the
        same rows here as in the update, so the first PPO ratio compares like with like."""
        h = self.h
        rows = batch["ids"].shape[0]
        C = h.mini_batches * h.micro_batches

        def chunks(x):
            return x.reshape(C, rows // C, *x.shape[1:])

        def one(xs):
            j, mic = xs
            logits, fstate = self._policy_logits(
                state.params, self.plan, mic, plen, jax.random.fold_in(key, 3 * j), values
            )
            o = {
                "old_logp": token_logprobs(logits, mic["tokens"], h.temperature),
                "entropy": losses.entropy_from_logits(logits / h.temperature),
                "fault_stats": fstate.get("fault_stats", {}),
            }
            if ref_params is not None:
                ref_logits, _ = self._policy_logits(
                    ref_params, self.plan, mic, plen, jax.random.fold_in(key, 3 * j + 1), values
                )
                o["ref_logp"] = token_logprobs(ref_logits, mic["tokens"], h.temperature)
            if h.estimator == "gae":
                o["values"] = self._values(
                    state.critic_params, mic, plen, jax.random.fold_in(key, 3 * j + 2), values
                )
            return o

        mics = {k: chunks(batch[k]) for k in ("ids", "mask", "tokens", "rmask")}
        outs = jax.lax.map(one, (jnp.arange(C), mics))
        stats = jax.tree_util.tree_map(lambda v: jnp.mean(v, axis=0), outs.pop("fault_stats"))
        out = {k: v.reshape(rows, *v.shape[2:]) for k, v in outs.items()}
        out["fault_stats"] = stats
        old_logp = out["old_logp"]
        mask = batch["rmask"]
        kl = None
        if ref_params is not None:
            kl = losses.kl_penalty(old_logp, out["ref_logp"], h.kl_type)
        rewards = adv_lib.token_level_rewards(
            scores, mask, kl if h.use_kl_in_reward else None, h.kl_coef
        )
        out["token_rewards"] = rewards
        if h.estimator == "gae":
            a, r = adv_lib.gae_advantage_return(rewards, out["values"], mask, h.gamma, h.lam)
            out.update(advantages=a, returns=r)
        else:
            # GRPO scores the outcome (the KL-in-reward term, if any, summed per response).
            seq = jnp.sum(rewards, axis=1)
            out["advantages"] = adv_lib.grpo_outcome_advantage(
                seq, mask, h.n, norm_by_std=h.estimator == "grpo"
            )
        return out

    def _update_fn(self, state: RLState, batch, key, values, plen):
        """PPO epochs over mini-batches (lax.scan), gradient accumulation over micro-batches."""
        h = self.h
        M, G = h.mini_batches, h.micro_batches

        def split(x):
            return x.reshape(M, G, x.shape[0] // (M * G), *x.shape[1:])

        mbatch = {k: split(v) for k, v in batch.items()}

        def actor_loss(params, mic, denom, k):
            logits, _ = self._policy_logits(params, self.plan, mic, plen, k, values)
            logits = logits / h.temperature
            logp = token_logprobs(logits, mic["tokens"], 1.0)
            mask = mic["rmask"]
            pg, aux = losses.policy_loss(
                logp,
                mic["old_logp"],
                mic["advantages"],
                mask,
                clip_low=h.clip_low,
                clip_high=h.clip_high,
                clip_ratio_c=h.clip_ratio_c,
                agg=h.agg,
                denom=denom,
            )
            ent = losses.agg_loss(losses.entropy_from_logits(logits), mask, h.agg, denom)
            loss = pg - h.entropy_coeff * ent
            kl_loss = jnp.zeros(())
            if h.use_kl_loss:
                kl_loss = losses.agg_loss(
                    losses.kl_penalty(logp, mic["ref_logp"], h.kl_type), mask, h.agg, denom
                )
                loss = loss + h.kl_loss_coef * kl_loss
            return loss, {"pg_loss": pg, "kl_loss": kl_loss, "entropy": ent, **aux}

        def critic_loss(cparams, mic, denom, k):
            v = self._values(cparams, mic, plen, k, values)
            loss, aux = losses.value_loss(
                v,
                mic["values"],
                mic["returns"],
                mic["rmask"],
                clip=h.vf_clip,
                agg=h.agg,
                denom=denom,
            )
            return loss, {
                "vf_loss": loss,
                **aux,
                "vpred_mean": adv_lib.masked_mean(v, mic["rmask"]),
            }

        def accumulate(loss_fn, params, mb, denom, base):
            def micro(carry, xs):
                grads, mets = carry
                j, mic = xs
                (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(
                    params, mic, denom, jax.random.fold_in(base, j)
                )
                grads = jax.tree_util.tree_map(jnp.add, grads, g)
                mets = jax.tree_util.tree_map(lambda a, b: a + b / G, mets, m)
                return (grads, mets), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            mic0 = jax.tree_util.tree_map(lambda x: x[0], mb)
            shapes = jax.eval_shape(lambda: loss_fn(params, mic0, denom, base)[1])
            mets0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            (grads, mets), _ = jax.lax.scan(micro, (zeros, mets0), (jnp.arange(G), mb))
            return grads, mets

        def minibatch(st: RLState, idx):
            mb = jax.tree_util.tree_map(lambda x: x[idx % M], mbatch)
            denom = losses.agg_denominator(mb["rmask"].reshape(-1, mb["rmask"].shape[-1]), h.agg)
            base = jax.random.fold_in(key, 10 + idx)
            mets = {}
            cparams, copt = st.critic_params, st.critic_opt_state
            if self.use_critic:
                cg, cm = accumulate(
                    critic_loss, cparams, mb, denom, jax.random.fold_in(base, 1 << 20)
                )
                cu, copt = self.critic_opt.update(cg, copt, cparams)
                cparams = optax.apply_updates(cparams, cu)
                mets.update({f"critic/{k}": v for k, v in cm.items()})
                mets["critic/grad_norm"] = optax.tree.norm(cg)
            g, am = accumulate(actor_loss, st.params, mb, denom, base)
            grad_norm = optax.tree.norm(g)
            # No actor update during the critic warm-up (verl critic_warmup).
            live = st.step >= h.critic_warmup if self.use_critic else jnp.bool_(True)
            u, opt = self.actor_opt.update(g, st.opt_state, st.params)
            params = jax.tree_util.tree_map(
                lambda p, q: jnp.where(live, q, p), st.params, optax.apply_updates(st.params, u)
            )
            opt = jax.tree_util.tree_map(lambda a, b: jnp.where(live, b, a), st.opt_state, opt)
            mets.update({f"actor/{k}": v for k, v in am.items()})
            mets["actor/grad_norm"] = grad_norm
            st = st.replace(
                params=params, opt_state=opt, critic_params=cparams, critic_opt_state=copt
            )
            return st, mets

        state, mets = jax.lax.scan(minibatch, state, jnp.arange(h.ppo_epochs * M))
        mets = jax.tree_util.tree_map(jnp.mean, mets)
        mets["actor/lr"] = jnp.asarray(self.actor_schedule(state.step * self.updates), jnp.float32)
        return state.replace(step=state.step + 1), mets

    # -- one RL step -------------------------------------------------------------------------
    def generation_weights(self):
        """The policy's weights for generation: the params in the compute dtype."""
        return self.state.params if self._cast is None else self._cast(self.state.params)

    def rollout(self, batch, step: int, sigma: float):
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        out = self.rollout_sampler(
            self.generation_weights(),
            batch["input_ids"],
            batch["attention_mask"],
            jax.random.fold_in(key, 0),
            fault_key=step_key(self.seed, step, "rollout"),
            values={AQN_SIGMA: np.float32(sigma)},
        )
        return out

    def train_batch(self, out, scores) -> dict[str, np.ndarray]:
        ids = np.concatenate([out.prompt_ids, out.tokens], axis=1).astype(np.int32)
        mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1).astype(np.int32)
        return {
            "ids": ids,
            "mask": mask,
            "tokens": out.tokens.astype(np.int32),
            "rmask": out.response_mask.astype(np.int32),
            "sampler_logp": out.logprobs.astype(np.float32),
            "scores": scores.astype(np.float32),
        }

    def step(self, step: int) -> dict[str, float]:
        """One RL step; returns its metrics (host floats)."""
        t_step = time.perf_counter()
        batch = self.batcher.next_batch()
        sigma = aqn_sigma(self.config, step, self.total_steps)
        t0 = time.perf_counter()
        out = self.rollout(batch, step, sigma)
        t_gen = time.perf_counter() - t0
        texts = [
            self.tokenizer.decode(t[m > 0])
            for t, m in zip(out.tokens, out.response_mask, strict=True)
        ]
        truths = [g for g in batch["ground_truth"] for _ in range(self.h.n)]
        scores = score_batch(texts, truths)
        tb = self.train_batch(out, scores)
        plen = int(out.prompt_ids.shape[1])
        values = {AQN_SIGMA: np.float32(sigma)}
        t0 = time.perf_counter()
        dev = parallel.put_batch({k: v for k, v in tb.items() if k not in ("scores",)}, self.mesh)
        train_key = step_key(self.seed, step, "train")
        scores_dev = parallel.put_batch(tb["scores"], self.mesh)
        prep = self._prepare(self.state, self.ref_params, dev, scores_dev, train_key, values, plen)
        prep = jax.block_until_ready(prep)
        t_prep = time.perf_counter() - t0
        upd = {k: dev[k] for k in ("ids", "mask", "tokens", "rmask")}
        upd.update({k: prep[k] for k in ("old_logp", "advantages")})
        if "ref_logp" in prep:
            upd["ref_logp"] = prep["ref_logp"]
        if self.use_critic:
            upd.update(values=prep["values"], returns=prep["returns"])
        t0 = time.perf_counter()
        self.state, mets = self._update(self.state, upd, train_key, values, plen)
        mets = {k: float(parallel.to_host(v)) for k, v in mets.items()}
        t_upd = time.perf_counter() - t0

        rmask = tb["rmask"]
        lengths = rmask.sum(1)
        old_logp = parallel.to_host(prep["old_logp"])
        drift = np.abs(old_logp - tb["sampler_logp"])[rmask > 0]
        adv = parallel.to_host(prep["advantages"])
        rewards = parallel.to_host(prep["token_rewards"]).sum(1)
        eos = (tb["tokens"] == self.tokenizer.eos_id).any(1)
        m: dict[str, float] = {
            "step": float(step),
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/advantages/mean": float(adv[rmask > 0].mean()),
            "critic/advantages/max": float(adv[rmask > 0].max()),
            "critic/advantages/min": float(adv[rmask > 0].min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(np.mean(~eos)),
            "prompt_length/mean": float(batch["prompt_len"].mean()),
            "training/rollout_probs_diff_mean": float(
                np.mean(np.abs(np.exp(old_logp) - np.exp(tb["sampler_logp"]))[rmask > 0])
            ),
            "training/rollout_logprob_diff_mean": float(drift.mean()),
            "training/rollout_logprob_diff_max": float(drift.max()),
            "aqn/sigma": float(sigma),
            "timing_s/gen": t_gen,
            "timing_s/old_log_prob": t_prep,
            "timing_s/update": t_upd,
            "timing_s/step": time.perf_counter() - t_step,
            "data/epoch": float(batch["epoch"]),
        }
        if self.use_critic:
            vals = parallel.to_host(prep["values"])
            m["critic/values/mean"] = float(vals[rmask > 0].mean())
            m["critic/returns/mean"] = float(parallel.to_host(prep["returns"])[rmask > 0].mean())
        m.update(mets)
        for name, v in summarize_stats(out.fault_stats).items():
            if name.endswith("/mean"):
                m[f"faults/rollout/{name.removesuffix('/mean')}"] = v
        for name, v in summarize_stats(
            jax.tree_util.tree_map(parallel.to_host, prep["fault_stats"])
        ).items():
            if name.endswith("/mean"):
                m[f"faults/train/{name.removesuffix('/mean')}"] = v
        check_finite(step, m)
        return m

    # -- validation ------------------------------------------------------------------------------
    def validate(self, step: int, size: int, batch_size: int) -> dict[str, float]:
        """Greedy accuracy on the first `size` test examples: on the faulty device (hardware
        faults, no AQN: `val-core/...`) and on a clean device (`val-clean/...`)."""
        examples = self.test_examples[:size]
        weights = self.generation_weights()
        out = {}
        for prefix, sampler in (("val-core", self.val_sampler), ("val-clean", self.clean_sampler)):
            scores = evaluate(
                sampler,
                weights,
                examples,
                self.tokenizer,
                batch_size,
                int(self.config.rollout.max_prompt_len),
                fault_key=step_key(self.seed, step, "eval"),
            )
            by_source: dict[str, list[float]] = {}
            for ex, s in zip(examples, scores, strict=True):
                by_source.setdefault(ex.data_source, []).append(float(s))
            for source, vals in by_source.items():
                out[f"{prefix}/{source}/acc/mean@1"] = float(np.mean(vals))
            out[f"{prefix}/acc"] = float(np.mean(scores))
        return out


def evaluate(
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
) -> np.ndarray:
    """verl scores (strict `####`) of `sampler`'s completions for every example, in order
    (the last batch padded with repeats of its first prompt, which are dropped); with
    `sampler.params.n > 1` each example's score is the mean over its n samples (mean@n).
    `texts`, when given, receives the decoded completions (n per example, in order)."""
    n = sampler.params.n
    scores = []
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
        arr = np.full((batch_size, width), tokenizer.pad_id, np.int32)
        mask = np.zeros((batch_size, width), np.int32)
        for r, i in enumerate(ids):
            arr[r, width - len(i) :] = i
            mask[r, width - len(i) :] = 1
        k = jax.random.key(0) if key is None else jax.random.fold_in(key, start)
        out = sampler(
            params, arr, mask, k, fault_key=k if fault_key is None else fault_key, values=values
        )
        texts_of_batch = [
            tokenizer.decode(t[m > 0]) for t, m in zip(out.tokens, out.response_mask, strict=True)
        ]
        truths = [ex.ground_truth for ex in chunk[:real] for _ in range(n)]
        decoded = texts_of_batch[: real * n]
        s = score_batch(decoded, truths).reshape(real, n).mean(axis=1)
        scores.extend(s.tolist())
        if texts is not None:
            texts.extend(decoded)
    return np.asarray(scores, np.float32)


def init_critic(model_config: Qwen2Config, policy_params):
    """The critic: the policy's backbone (embed, layers, final norm) and a fresh value head
    (zero-initialised: every value starts at 0)."""
    backbone = {k: v for k, v in policy_params.items() if k != "lm_head"}
    D = model_config.hidden_size
    head = {"kernel": np.zeros((D, 1), np.float32), "bias": np.zeros((1,), np.float32)}
    return {**jax.tree_util.tree_map(np.array, backbone), "value_head": head}


def total_steps_of(config, batches_per_epoch: int) -> int:
    """RL steps of a run: config.trainer.total_epochs full passes when set, else total_steps."""
    epochs = int(config.trainer.get("total_epochs", 0))
    return epochs * int(batches_per_epoch) if epochs > 0 else int(config.trainer.total_steps)


def check_finite(step: int, metrics: Mapping[str, float]) -> None:
    """Raise naming the step and the metric on NaN/Inf (the run stops; nothing is saved)."""
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(
            f"RL step {step}: non-finite metric(s) {bad} (e.g. {bad[0]}={metrics[bad[0]]})"
        )


ProgressFn = Callable[[int, Mapping[str, float]], None]
