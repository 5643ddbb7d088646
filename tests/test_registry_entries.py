"""Issue 70 item 2: every name table is one `Registry` whose entries carry what their callers
read. Each test registers a throwaway entry, sees it reach its consumer (a report, a check, a
kernel, a trial's config), then unregisters it and sees the one-line refusal naming the field,
the value and the allowed names."""

from __future__ import annotations

import contextlib

import ml_collections
import numpy as np
import pytest


@contextlib.contextmanager
def throwaway(registry, name, entry):
    """`entry` registered as `name` for the block, removed after (whatever the block raised)."""
    registry.register(name, entry)
    try:
        yield entry
    finally:
        registry.unregister(name)
    assert name not in registry


def _one_line(err, text):
    message = str(err.value)
    assert "\n" not in message and message == text, message


def test_a_new_reward_method_reaches_the_checks_the_prompts_and_the_evaluate_report(tmp_path):
    from aqn_jax import rewards
    from aqn_jax.data.config import Example, check_data, data_config, shot_answer
    from aqn_jax.jobs.evaluate import write_evaluation_report

    entry = rewards.Method(
        extract=lambda s: s.split()[-1] if s.split() else None,
        equal=lambda a, b: a == b,
        title="TOY: the last word",
        shot=lambda truth: f"Answer: {truth}",
    )
    result = {
        "policy": "toy policy",
        "test_size": 2,
        "wall_time_s": 1.0,
        "reward_method": "lastword",
        "conditions": {"clean": {"fault": False, "acc": 0.5, "samples": 1}},
    }
    data = data_config()
    data.reward_method = "lastword"
    ex = Example("1+1?", [], "2", 0, answer="1+1=2 #### 2")
    with throwaway(rewards.METHODS, "lastword", entry):
        check_data(data)  # accepted by name
        assert rewards.compute_score("so it is 7", "7", method="lastword") == 1.0
        assert shot_answer(ex, "lastword") == "1+1=2\nAnswer: 2"
        write_evaluation_report(result, str(tmp_path))
        text = (tmp_path / "evaluation.md").read_text()
        assert "accuracy (TOY: the last word), mean@1" in text
    allowed = rewards.METHODS.names()
    line = f"config.data.reward_method='lastword'; allowed: {allowed}"
    with pytest.raises(ValueError) as err:
        check_data(data)
    _one_line(err, line)
    with pytest.raises(ValueError) as err:  # the report: the same line, no KeyError
        write_evaluation_report(result, str(tmp_path / "again"))
    _one_line(err, line)
    # The shipped methods' titles and shown answers, as the report and prompts had them.
    assert [rewards.METHODS[m].title for m in allowed] == [
        "strict `####`",
        "flexible: the last number",
        "boxed: the last `\\boxed{}`, else `####`",
    ]
    assert shot_answer(ex, "boxed").endswith("\n\\boxed{2}")
    assert shot_answer(ex, "strict").endswith("\n#### 2")


def _tiny_model():
    from aqn_jax.models.factory import model_config
    from configs.base import get_config

    return model_config(get_config("smoke").model)


def _block_section(fmt: str, block_size: int) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            enabled=True,
            target="activation",
            format=fmt,
            block_size=block_size,
            sites="q_proj",
            point="input",
            scale_rule="floor",
            rounding="away",
        )
    )


def test_a_new_block_format_reaches_the_format_checks_and_the_kernel():
    import jax.numpy as jnp

    from aqn_jax.checks import check_block_widths
    from aqn_jax.faults import formats
    from aqn_jax.faults.config import check_formats, faults_config

    model_cfg = _tiny_model()
    faults = faults_config()
    faults.quant = _block_section("toy_fp4_b8", 32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)), jnp.float32)
    mxfp4 = formats.FORMATS["mxfp4"].spec
    # A block format whose block length is its own (8, NVFP4-style), on the MX kernel.
    with throwaway(formats.FORMATS, "toy_fp4_b8", formats.Format(mxfp4, "mx", 8)):
        check_formats(faults.quant, "config.faults.quant")  # the format accepted by name
        assert formats.check_block_size("toy_fp4_b8", 32) == 8  # its own block, not 32
        check_block_widths(faults, model_cfg)  # blocks of 8 divide every width
        np.testing.assert_array_equal(  # the kernel reads the entry: MXFP4 in blocks of 8
            formats.quantize_mx(x, "toy_fp4_b8", block_size=8),
            formats.quantize_mx(x, "mxfp4", block_size=8),
        )
        assert formats.scale_blocks(x.shape, "toy_fp4_b8") == (4, 8)
    with throwaway(formats.FORMATS, "toy_fp4_b7", formats.Format(mxfp4, "mx", 7)):
        faults.quant.format = "toy_fp4_b7"
        with pytest.raises(ValueError) as err:  # its fixed block is checked as the format's
            check_block_widths(faults, model_cfg)
        assert str(err.value).startswith(
            "config.faults.quant.format='toy_fp4_b7': blocks of 7 do not divide"
        )
    faults.quant.format = "toy_fp4_b8"
    with pytest.raises(ValueError) as err:
        check_formats(faults.quant, "config.faults.quant")
    _one_line(err, f"config.faults.quant.format='toy_fp4_b8'; allowed: {formats.FORMATS.names()}")
    with pytest.raises(ValueError) as err:
        formats.quantize_mx(x, "toy_fp4_b8")
    _one_line(err, f"fmt='toy_fp4_b8'; allowed: {formats.MX_FORMATS}")


def test_a_new_block_format_fault_kind_gets_its_widths_checked():
    from aqn_jax.checks import check_block_widths
    from aqn_jax.faults.config import FAULT_KINDS, FaultKind, faults_config

    model_cfg = _tiny_model()

    def section():
        return _block_section("mxfp4", 7)

    for block_format in (True, False):
        kind = FaultKind(build=lambda sec, n: [], section=section, block_format=block_format)
        with throwaway(FAULT_KINDS, "toy_block", kind):
            faults = faults_config()
            assert "toy_block" in faults
            if block_format:  # read from the entry: no list of kinds to extend
                with pytest.raises(ValueError) as err:
                    check_block_widths(faults, model_cfg)
                assert str(err.value).startswith(
                    "config.faults.toy_block.block_size=7: blocks of 7 do not divide"
                )
            else:
                check_block_widths(faults, model_cfg)  # not a block format: not checked
    assert [k for k, e in FAULT_KINDS.items() if e.block_format] == ["quant", "mx_scale_flip"]
    assert "toy_block" not in faults_config()


def test_a_new_vulnerability_site_plants_its_flip_and_is_listed(tmp_path):
    from aqn_jax.jobs import vulnerability as job
    from aqn_jax.study import sdc
    from configs.vulnerability import get_config

    config = get_config("smoke")
    config.vulnerability.sites = ("toy_site",)
    site = job.Site(
        "TOY: the up projections' outputs", dict(target="activation", sites=("up_proj",))
    )
    with throwaway(job.SITES, "toy_site", site):
        job.check_study(config)  # accepted by name
        bit = config.vulnerability.bits[0]
        trial = job.trial_config(config, str(tmp_path), 0, "toy_site", bit, False)
        assert trial.faults.bitflip.enabled and tuple(trial.faults.bitflip.sites) == ("up_proj",)
        result = {
            "model": "toy",
            "dtype": "float32",
            "steps": 2,
            "fire_step": 1,
            "count": 1,
            "trials": 1,
            "seeds": [0],
            "val_size": 8,
            "bits": [bit],
            "sites": ["toy_site"],
            "site_descriptions": {"toy_site": site.description},
            "cells": {},
            "wall_s": 1.0,
        }
        path = sdc.write_report(str(tmp_path), result)
        with open(path) as f:
            text = f.read()
        assert "| bit | toy_site |" in text
        assert "- toy_site: TOY: the up projections' outputs" in text
    with pytest.raises(ValueError) as err:
        job.check_study(config)
    _one_line(err, f"config.vulnerability.sites=('toy_site',); allowed: {job.SITES.names()}")


def test_a_new_hf_family_maps_its_model_type():
    from aqn_jax.models import hf_mapping

    family = hf_mapping.HfFamily(
        "ToyForCausalLM",
        False,
        {"toy_field": (lambda v: v == 1, "1 (the toy's only state)")},
        {"toy_field": 1},
    )
    hf = {"model_type": "toy", "architectures": ["LlamaForCausalLM"]}
    with throwaway(hf_mapping.HF_FAMILIES, "toy", family):
        with pytest.raises(ValueError) as err:  # the entry's architecture is the one expected
            hf_mapping.config_from_hf(hf)
        assert str(err.value).endswith("expected 'ToyForCausalLM' for toy")
        with pytest.raises(ValueError) as err:  # ... and its own checked fields apply
            hf_mapping.config_from_hf({**hf, "architectures": ["ToyForCausalLM"], "toy_field": 3})
        assert str(err.value).endswith("of toy; allowed: 1 (the toy's only state)")
    with pytest.raises(ValueError) as err:
        hf_mapping.config_from_hf(hf)
    allowed = hf_mapping.HF_FAMILIES.names()
    _one_line(err, f"config.json: model_type='toy'; allowed: {allowed}")
    assert allowed == ("qwen2", "llama", "mistral")


def test_hf_family_entries_write_what_the_tables_wrote():
    """config_to_hf / config_from_hf per shipped family (the fields each family's entry carries)."""
    import dataclasses

    from aqn_jax.models import hf_mapping
    from aqn_jax.models.qwen2 import Qwen2Config

    base = Qwen2Config.preset("tiny")
    for model_type, arch, extra in (
        ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": False}),
        ("llama", "LlamaForCausalLM", {"attention_bias": False, "pretraining_tp": 1}),
        ("mistral", "MistralForCausalLM", {"attention_bias": False, "sliding_window": None}),
    ):
        cfg = dataclasses.replace(base, model_type=model_type, attention_bias=model_type == "qwen2")
        hf = hf_mapping.config_to_hf(cfg)
        assert hf["architectures"] == [arch] and hf["model_type"] == model_type
        assert {k: hf[k] for k in extra} == extra
        back, _ = hf_mapping.config_from_hf(hf)
        assert back.attention_bias == (model_type == "qwen2") and back.model_type == model_type


def test_rl_config_reads_its_choices_from_the_registries():
    from aqn_jax.rl import config as rl_config
    from aqn_jax.rl import losses

    algo, actor = rl_config.algo_config(), rl_config.actor_config()
    assert rl_config._check_choices(algo, actor) == "auto"
    for section, field, registry in (
        (algo, "loss_agg_mode", losses.AGG),
        (algo, "kl_type", losses.KL_ESTIMATORS),
        (actor, "old_logp_pass", rl_config.OLD_LOGP_PASS),
    ):
        good = section[field]
        section[field] = "toy"
        with throwaway(registry, "toy", None):  # a new name is accepted where it is registered
            rl_config._check_choices(algo, actor)
        with pytest.raises(ValueError) as err:
            rl_config._check_choices(algo, actor)
        _one_line(err, f"{registry.field}='toy'; allowed: {registry.names()}")
        section[field] = good
