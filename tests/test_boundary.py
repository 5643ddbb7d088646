"""The typed boundary: `config.algo` parsed in one place (`rl.config.Hyper.of`), `checks.py`
free of ml_collections, and the boundary's functions short enough to read in one screen."""

import ast
import pathlib

import pytest

from aqn_jax.experiment import base_config
from aqn_jax.rl import advantages as adv_lib
from aqn_jax.rl import losses
from aqn_jax.rl.config import Hyper, algo_config
from aqn_jax.rl.rollout_correction import RolloutCorrection
from aqn_jax.spec import step_spec

from conftest import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def hyper(config) -> Hyper:
    return Hyper.of(
        config.algo,
        rollout=config.rollout,
        actor=config.actor,
        critic=config.critic,
        prompts=config.data_batch.prompts,
    )


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_checks_does_not_import_ml_collections():
    assert "ml_collections" not in _imports(ROOT / "aqn_jax" / "checks.py")
    assert "ml_collections" in _imports(ROOT / "aqn_jax" / "config.py")  # the control


def _lengths(path: pathlib.Path) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    return {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
    }


def test_the_boundary_reads_in_one_screen():
    assert _lengths(ROOT / "aqn_jax" / "experiment.py")["base_config"] <= 60
    assert _lengths(ROOT / "aqn_jax" / "checks.py")["check_train"] <= 80


def test_base_config_algo_is_its_defaults_function():
    assert base_config().algo.to_json() == algo_config().to_json()
    assert list(base_config().algo) == list(algo_config())  # config.json's order


def test_hyper_of_the_default_config_field_by_field():
    h = hyper(base_config())
    assert (h.estimator, h.n, h.temperature, h.agg) == ("grpo", 5, 1.0, "token-mean")
    assert h.policy_loss == losses.PolicyLoss(
        "ppo", (("clip_high", 0.2), ("clip_low", 0.2), ("clip_ratio_c", 3.0))
    )
    assert (h.use_kl_loss, h.kl_loss_coef, h.kl_type) == (True, 0.001, "low_var_kl")
    assert (h.use_kl_in_reward, h.kl_coef, h.entropy_coeff) == (False, 0.001, 0.0)
    assert (h.gamma, h.lam, h.vf_clip, h.critic_warmup) == (1.0, 1.0, 0.5, 0)
    # 16 prompts in mini-batches of 8; 8 x 5 rows in micro-batches of 40.
    assert (h.ppo_epochs, h.mini_batches, h.micro_batches, h.micro_rows) == (1, 2, 1, 40)
    assert h.correction == RolloutCorrection() and not h.correction.needs_rollout_logprobs
    assert (h.old_logp_pass, h.share_prompt, h.skip_zero_advantage) == ("auto", True, True)
    assert h.use_ref and not h.on_policy  # two mini-batches
    assert step_spec(base_config()).h == h  # the step's spec parses it the same way


def test_hyper_of_other_configs_field_by_field():
    smoke = hyper(base_config("smoke"))  # 4 prompts in mini-batches of 2; 2 x 5 rows by 10
    assert (smoke.mini_batches, smoke.micro_batches, smoke.micro_rows) == (2, 1, 10)
    config = base_config()
    config.algo.estimator, config.rollout.n, config.rollout.temperature = "gae", 1, 0.0
    config.algo.policy_loss, config.actor.micro_batch_rows = "gspo", 8
    config.critic.cliprange_value, config.critic.warmup_steps = 0.2, 3
    config.actor.old_logp_pass, config.actor.share_prompt = "always", False
    gae = hyper(config)
    assert (gae.estimator, gae.n, gae.temperature) == ("gae", 1, 1.0)  # 0: greedy, logp at 1
    assert gae.policy_loss == losses.PolicyLoss("gspo", (("clip_high", 4e-4), ("clip_low", 3e-4)))
    assert (gae.vf_clip, gae.critic_warmup, gae.old_logp_pass) == (0.2, 3, "always")
    assert not gae.share_prompt and gae.skip_zero_advantage
    assert (gae.mini_batches, gae.micro_batches, gae.micro_rows) == (2, 1, 8)  # 8 x 1 rows
    qerl = hyper(load_config("qerl", "smoke"))
    assert qerl == step_spec(load_config("qerl", "smoke")).h and qerl.estimator == "grpo"


@pytest.mark.parametrize(
    "field, table",
    [
        ("estimator", adv_lib.ESTIMATORS),
        ("policy_loss", losses.POLICY_LOSSES),
        ("kl_type", losses.KL_TYPES),
        ("loss_agg_mode", losses.AGG_MODES),
    ],
)
def test_an_unknown_name_is_one_line_with_the_allowed_names(field, table):
    config = base_config()
    config.algo[field] = "nope"
    with pytest.raises(ValueError) as e:
        hyper(config)
    assert str(e.value) == f"config.algo.{field}='nope'; allowed: {tuple(table)}"
