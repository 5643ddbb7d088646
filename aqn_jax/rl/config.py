"""The RL sections: `config.algo` (its defaults, its typed `Hyper` and their checks, in
`Hyper.of`) and the defaults of `config.data_batch`, `config.rollout`, `config.actor` and
`config.critic`."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from aqn_jax.registry import Registry

from . import advantages as adv_lib
from . import losses
from .rollout_correction import RolloutCorrection, correction_config, correction_from

# config.actor.old_logp_pass: 'auto' (an on-policy update reuses its own log-probs, no
# separate pass), 'always' (a separate pass before the update); see `actor_config`.
OLD_LOGP_PASS = Registry("config.actor.old_logp_pass")
OLD_LOGP_PASS.register("auto", None)
OLD_LOGP_PASS.register("always", None)


def algo_config() -> ml_collections.ConfigDict:
    """`config.algo`: the RL objective (verl algorithm / actor)."""
    algo = ml_collections.ConfigDict()
    algo.estimator = "grpo"  # grpo | drgrpo | gae (PPO with a critic)
    losses.policy_loss_config(algo)  # policy_loss (ppo | gspo) and each loss's clip range
    algo.loss_agg_mode = "token-mean"  # how token losses average (rl/losses.AGG_MODES)
    algo.use_kl_loss = True  # KL to the reference policy as a loss term (GRPO)
    algo.kl_loss_coef = 0.001  # its weight (0.001)
    algo.kl_type = "low_var_kl"  # low_var_kl | kl | mse | abs
    algo.use_kl_in_reward = False  # KL as a per-token reward penalty (PPO)
    algo.kl_coef = 0.001  # KL-in-reward coefficient
    algo.entropy_coeff = 0.0  # entropy bonus weight (0 = none)
    algo.gamma = 1.0  # GAE discount per token (1.0)
    algo.lam = 1.0  # GAE lambda (1.0)
    # Rollout correction (aqn_jax/rl/rollout_correction.py): sampler vs trainer log-probs.
    correction_config(algo)
    return algo


def data_batch_config() -> ml_collections.ConfigDict:
    """`config.data_batch`: the RL batch."""
    c = ml_collections.ConfigDict()
    c.prompts = 16  # prompts per RL step (verl train_batch_size)
    return c


def rollout_config() -> ml_collections.ConfigDict:
    """`config.rollout`: generation (verl actor_rollout_ref.rollout), sized for the embedded
    task (its chat prompts are 24-69 characters long)."""
    c = ml_collections.ConfigDict()
    c.n = 5  # samples per prompt (GRPO group)
    c.temperature = 1.0  # sampling temperature (1.0; 0 = greedy)
    c.top_k = 0  # 0 = off
    c.top_p = 1.0  # nucleus mass (1.0 = off)
    c.max_new_tokens = 24  # answers are ~17 characters + EOS
    # Every RL row is bucket + max_new_tokens: one bucket just above the longest prompt.
    c.max_prompt_len = 72  # tokens; longer train prompts are dropped
    c.prompt_buckets = (72,)  # padded prompt widths, tokens (one program each)
    # Each distinct prompt prefilled once for its n samples (off where a fault's values would
    # differ: `FaultPlan.split_refusals`).
    c.share_prompt = True
    # The prefix every prompt of a call starts with (the chat template's system turn, a worked
    # example) prefilled once, in the rollout, validation and evaluation (off where a fault's
    # values would differ: `FaultPlan.prefix_refusals`).
    c.share_prefix = True
    # Greedy decoding (validation, evaluation) retires its finished rows: once at most half of a
    # batch still runs, the decode goes on with a batch half as large (off where a fault's
    # values would differ: `FaultPlan.prefix_refusals`; sampled rollouts keep every row).
    c.retire_rows = True
    return c


def actor_config() -> ml_collections.ConfigDict:
    """`config.actor`: the policy's optimizer and PPO batching."""
    c = ml_collections.ConfigDict()
    # From the shipped warm start, a higher rate lowers the clean device's greedy accuracy;
    # this one holds it and wins back part of the fault's cost.
    c.lr = 3e-5  # AdamW learning rate
    c.warmup_steps = 0  # RL steps of linear warmup
    c.schedule = "constant"  # constant | warmup_constant | cosine
    c.weight_decay = 0.01  # decoupled AdamW weight decay
    c.grad_clip = 1.0  # global-norm clip (0 = off)
    c.ppo_epochs = 1  # passes over each RL batch
    c.mini_batch_prompts = 8  # PPO mini-batch, in prompts (x n rows)
    c.micro_batch_rows = 40  # gradient-accumulation chunk, in rows
    # The old log-probs of the PPO ratio. 'auto': when the update is on-policy (one epoch, one
    # mini-batch, no rollout correction, no KL in the reward, no SDC), they are the update's
    # own log-probs, detached (TRL's and verl's shortcut: ratio 1 exactly), with no separate
    # forward pass; 'always': a separate pass before the update, as with several mini-batches.
    c.old_logp_pass = "auto"
    # The passes over rollout rows compute a group's prompt once (`forward.SharedPrompt`), and
    # the update does not run micro-batches of rows without an advantage (exact with no
    # entropy bonus, KL loss or critic); each is off, with the reason logged, where it would
    # change the result.
    c.share_prompt = True
    c.skip_zero_advantage = True
    return c


def critic_config() -> ml_collections.ConfigDict:
    """`config.critic`: the value model, used by estimator='gae'."""
    c = ml_collections.ConfigDict()
    c.lr = 1e-4  # AdamW learning rate
    c.lr_warmup_steps = 0  # RL steps of linear warmup
    c.schedule = "constant"  # constant | warmup_constant | cosine
    c.weight_decay = 0.01  # decoupled AdamW weight decay
    c.grad_clip = 1.0  # global-norm clip (0 = off)
    c.cliprange_value = 0.5  # value clip around the old values (0.5)
    c.warmup_steps = 0  # RL steps that update only the critic
    c.faults = False  # run the hardware faults in the critic too
    return c


def flag(section: Any, path: str, name: str, default: bool = True) -> bool:
    """A boolean field of a config section (`path` its name), refused in one line when it is
    not a bool."""
    v = section.get(name, default)
    if not isinstance(v, bool):
        raise ValueError(f"{path}.{name}={v!r}; allowed: True, False")
    return v


@dataclasses.dataclass(frozen=True)
class Hyper:
    """The static settings of the jitted programs: config.algo, typed (`Hyper.of`), with the
    batching it is run at (config.rollout / actor / critic / data_batch)."""

    estimator: str
    n: int
    temperature: float
    policy_loss: losses.PolicyLoss  # config.algo.policy_loss and its entry's settings
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
    correction: RolloutCorrection = RolloutCorrection()  # config.algo.rollout_* / bypass_mode
    old_logp_pass: str = "auto"  # config.actor.old_logp_pass (OLD_LOGP_PASS)
    micro_rows: int = 1  # config.actor.micro_batch_rows
    share_prompt: bool = False  # config.actor.share_prompt: a group's prompt computed once
    skip_zero_advantage: bool = False  # config.actor.skip_zero_advantage: silent rows not run

    @classmethod
    def of(cls, algo: Any, *, rollout: Any, actor: Any, critic: Any, prompts: int) -> Hyper:
        """`algo` (config.algo) typed and checked, with config.rollout / actor / critic and
        config.data_batch.prompts (`prompts`); raises one line naming the field."""
        _check_positive(rollout, actor, prompts)
        _check_estimator(algo, rollout)
        _check_division(rollout, actor, prompts)
        old_pass = _check_choices(algo, actor)
        policy_loss = losses.policy_loss_from(algo)
        correction = correction_from(algo, rollout)
        _check_temperature(algo, rollout)
        prompts, rows = int(prompts), int(actor.mini_batch_prompts) * int(rollout.n)
        return cls(
            estimator=algo.estimator,
            n=int(rollout.n),
            temperature=float(rollout.temperature) or 1.0,
            policy_loss=policy_loss,
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
            vf_clip=float(critic.cliprange_value),
            critic_warmup=int(critic.warmup_steps),
            correction=correction,
            old_logp_pass=old_pass,
            micro_rows=int(actor.micro_batch_rows),
            share_prompt=flag(actor, "config.actor", "share_prompt"),
            skip_zero_advantage=flag(actor, "config.actor", "skip_zero_advantage"),
        )

    def skip_refusals(self, critic: bool) -> list[str]:
        """Why a row without an advantage would still add to the loss (empty: the skip is
        exact): an entropy bonus, a KL loss or a critic give such a row a term of its own."""
        out = []
        if self.entropy_coeff:
            out.append(f"config.algo.entropy_coeff={self.entropy_coeff}")
        if self.use_kl_loss:
            out.append("config.algo.use_kl_loss=True")
        if critic:
            out.append(f"config.algo.estimator={self.estimator!r} trains a critic")
        return out

    @property
    def use_ref(self) -> bool:
        """A reference policy (its params and passes): the KL loss or the KL in the reward."""
        return self.use_kl_loss or self.use_kl_in_reward

    @property
    def on_policy(self) -> bool:
        """The update sees the policy that sampled before any optimizer step: one epoch, one
        mini-batch, no rollout correction (it compares the trainer's old log-probs with the
        sampler's before the update) and no KL in the reward (it needs them too)."""
        return (
            self.ppo_epochs == 1
            and self.mini_batches == 1
            and not self.correction.needs_rollout_logprobs
            and not self.use_kl_in_reward
        )


def _check_positive(rollout: Any, actor: Any, prompts: int) -> None:
    """The batch sizes and epochs: positive."""
    for field, value in (
        ("data_batch.prompts", prompts),
        ("rollout.n", rollout.n),
        ("actor.ppo_epochs", actor.ppo_epochs),
        ("actor.mini_batch_prompts", actor.mini_batch_prompts),
        ("actor.micro_batch_rows", actor.micro_batch_rows),
    ):
        if value < 1:
            raise ValueError(f"config.{field}={value}; must be a positive int")


def _check_estimator(algo: Any, rollout: Any) -> None:
    """config.algo.estimator: registered, and given a group of samples when it compares them."""
    adv_lib.ESTIMATORS.check(algo.estimator)
    if adv_lib.ESTIMATORS[algo.estimator].grouped and int(rollout.n) < 2:
        raise ValueError(
            f"config.rollout.n={rollout.n}; must be >= 2 with"
            f" config.algo.estimator={algo.estimator!r} (its advantage compares the n samples of"
            " a prompt; n=1 needs estimator 'gae')"
        )


def _check_division(rollout: Any, actor: Any, prompts: int) -> None:
    """The mini-batch divides the batch's prompts, the micro-batch the mini-batch's rows."""
    prompts = int(prompts)
    if prompts % int(actor.mini_batch_prompts):
        raise ValueError(
            f"config.actor.mini_batch_prompts={actor.mini_batch_prompts} must divide"
            f" config.data_batch.prompts={prompts}"
        )
    rows = int(actor.mini_batch_prompts) * int(rollout.n)
    if rows % int(actor.micro_batch_rows):
        raise ValueError(
            f"config.actor.micro_batch_rows={actor.micro_batch_rows} must divide the mini-batch"
            f" rows mini_batch_prompts*n = {rows}"
        )


def _check_choices(algo: Any, actor: Any) -> str:
    """config.algo.loss_agg_mode and kl_type, and config.actor.old_logp_pass (returned)."""
    losses.AGG.check(algo.loss_agg_mode)
    losses.KL_ESTIMATORS.check(algo.kl_type)
    return OLD_LOGP_PASS.check(actor.get("old_logp_pass", "auto"))


def _check_temperature(algo: Any, rollout: Any) -> None:
    """Greedy sampling gives a grouped estimator n equal samples: no signal."""
    if adv_lib.ESTIMATORS[algo.estimator].grouped and float(rollout.temperature) == 0:
        raise ValueError(
            f"config.rollout.temperature=0 samples greedily: the rollout.n={rollout.n}"
            f" samples of a prompt are one answer, so config.algo.estimator={algo.estimator!r}"
            " (it compares them) has no signal in any group; allowed: temperature > 0"
        )
