"""The one registry helper (aqn_jax/registry.py) and the tables built on it."""

import pytest


def test_registry_refuses_unknown_and_duplicate_names():
    from aqn_jax.registry import Registry

    reg = Registry("config.x.kind")

    @reg.register("a")
    def a():
        return 1

    reg.register("b", 2)
    assert reg.names() == ("a", "b") and reg.get("a") is a and reg["b"] == 2
    assert "a" in reg and "c" not in reg and len(reg) == 2
    with pytest.raises(ValueError, match=r"^config\.x\.kind='c'; allowed: \('a', 'b'\)$"):
        reg.get("c")
    with pytest.raises(ValueError, match=r"^config\.y=None; allowed"):
        reg.check(None, "config.y")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a", 3)
    reg.unregister("b")
    assert reg.names() == ("a",)
    reg.register("none", None)  # a None entry is an entry, not the decorator form
    assert reg.names() == ("a", "none") and reg.get("none") is None


def _refuses(registry, field):
    """`registry` refuses an unknown name in one line naming `field` and its allowed names."""
    with pytest.raises(ValueError) as err:
        registry.get("no-such-entry")
    assert str(err.value) == f"{field}='no-such-entry'; allowed: {registry.names()}"
    assert len(registry) and "\n" not in str(err.value)


def test_rl_registries_refuse_an_unknown_name_naming_their_config_field():
    import ml_collections

    from aqn_jax import rewards
    from aqn_jax.rl import advantages, losses, optim, rollout_correction
    from aqn_jax.rl.config import correction_config

    _refuses(losses.POLICY_LOSSES, "config.algo.policy_loss")
    _refuses(losses.KL_ESTIMATORS, "config.algo.kl_type")
    _refuses(losses.AGG, "config.algo.loss_agg_mode")
    _refuses(advantages.ESTIMATORS, "config.algo.estimator")
    _refuses(rewards.METHODS, "config.data.reward_method")
    _refuses(optim.LR_SCHEDULES, "config.actor.schedule")
    for field, entry in rollout_correction.CORRECTIONS.items():
        _refuses(entry.levels, f"config.algo.{field}")
    # ... and so do the functions that read the config through them.
    rollout = ml_collections.ConfigDict({"temperature": 1.0, "top_k": 0, "top_p": 1.0})

    def correction(field):
        algo = ml_collections.ConfigDict()
        correction_config(algo)
        algo[field] = "bogus"
        return rollout_correction.correction_from(algo, rollout)

    cases = [
        (lambda: losses.policy_loss_from({"policy_loss": "bogus"}), losses.POLICY_LOSSES),
        (lambda: losses.kl_penalty(0.0, 0.0, "bogus"), losses.KL_ESTIMATORS),
        (lambda: losses.agg_loss(0.0, 0.0, "bogus"), losses.AGG),
        (lambda: rewards.compute_score("#### 1", "1", method="bogus"), rewards.METHODS),
    ]
    for field, entry in rollout_correction.CORRECTIONS.items():
        assert entry.levels.names()[0] == "none"  # every correction can be off
        cases.append((lambda field=field: correction(field), entry.levels))
    for call, registry in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == f"{registry.field}='bogus'; allowed: {registry.names()}"
    # A table shared by several sections names the section it was read from.
    with pytest.raises(ValueError) as err:
        optim.lr_schedule(1e-6, 10, schedule="bogus", field="config.critic")
    allowed = optim.LR_SCHEDULES.names()
    assert str(err.value) == f"config.critic.schedule='bogus'; allowed: {allowed}"


def test_a_registered_policy_loss_is_one_function_and_its_settings_reader():
    """A throwaway policy loss, registered here alone: policy_loss_from finds it and reads its
    settings; the other entries' fields away from their defaults are refused for it."""
    import jax.numpy as jnp

    from aqn_jax.rl import losses

    def settings(algo):
        return {"scale": float(algo.get("toy_scale", 1.0))}

    @losses.register_policy_loss("toy", settings, {"toy_scale": (1.0, "the toy's scale")})
    def toy(logp, old, adv, mask, *, scale, agg="token-mean", denom=None, weights_NT=None):
        return scale * losses.agg_loss(-adv * logp, mask, agg, denom), {}

    try:
        assert "toy" in losses.POLICY_LOSSES.names()
        spec = losses.policy_loss_from({"policy_loss": "toy", "toy_scale": 2.0})
        assert spec == losses.PolicyLoss("toy", (("scale", 2.0),))
        ones = jnp.ones((1, 2))
        assert float(spec(ones, ones, ones, ones)[0]) == -2.0
        with pytest.raises(ValueError, match=r"^config\.algo\.toy_scale=2\.0: the toy's scale"):
            losses.policy_loss_from({"policy_loss": "ppo", "toy_scale": 2.0})
    finally:
        losses.POLICY_LOSSES.unregister("toy")
    assert "toy" not in losses.POLICY_LOSSES
