"""One-line refusals before any work, and nothing written (issue 50): each bad value below is
refused by `launch.run` naming the field, the value and what is allowed, before the warm start
(no SFT cache made), leaving the workdir byte-identical; its valid neighbour passes the same
checks (a negative control)."""

import pytest

from conftest import launch_cli, load_config, tree_state


def _set(config, **over):
    for key, value in over.items():
        node, *path = key.split(".")
        target = config[node]
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
    return config


def _scale_flip(**over):
    return {"faults.mx_scale_flip.enabled": True, "faults.mx_scale_flip.count": 1, **over}


def _bitflip(**over):
    return {"faults.bitflip.enabled": True, "faults.bitflip.count": 1, **over}


# (id, config name and arg, bad fields, the one line's text, the valid neighbour's fields)
CASES = [
    (
        "mx_scale_flip_block_0",
        ("base", "smoke"),
        _scale_flip(**{"faults.mx_scale_flip.block_size": 0}),
        "config.faults.mx_scale_flip.block_size=0; allowed: a positive int",
        _scale_flip(**{"faults.mx_scale_flip.block_size": 32}),
    ),
    (
        "mx_scale_flip_block_7",
        ("base", "smoke"),
        _scale_flip(**{"faults.mx_scale_flip.block_size": 7}),
        "config.faults.mx_scale_flip.block_size=7: blocks of 7 do not divide the 128 lanes of"
        " q_proj's input (the last axis); allowed: a block size dividing 128",
        _scale_flip(**{"faults.mx_scale_flip.block_size": 64}),
    ),
    (
        "bitflip_steps_negative",
        ("base", "smoke"),
        _bitflip(**{"faults.bitflip.steps": "(-3,)"}),
        "config.faults.bitflip.steps='(-3,)'; RL steps count from 1; allowed: 'all', a step",
        _bitflip(**{"faults.bitflip.steps": "(3,)"}),
    ),
    (
        "lora_rank_above_the_narrowest",
        ("qerl", "nvfp4_lora,smoke"),
        {"lora.rank": 100000},
        "config.lora.rank=100000 exceeds min(in, out) = 64 of layers_0/self_attn/k_proj (128 x"
        " 64), the narrowest targeted linear; allowed: 1..64",
        {"lora.rank": 64},
    ),
    (
        "qerl_float16",
        ("qerl", "nvfp4_lora,smoke"),
        {"model.param_dtype": "float16", "model.dtype": "float16"},
        "config.model.param_dtype='float16': training in float16 overflows",
        {"model.param_dtype": "bfloat16", "model.dtype": "bfloat16"},
    ),
    (
        "vulnerability_no_bits",
        ("vulnerability", "smoke"),
        {"vulnerability.bits": ()},
        "config.vulnerability.bits=(); allowed: a non-empty tuple",
        {"vulnerability.bits": ("e7",)},
    ),
    (
        "vulnerability_count",
        ("vulnerability", "smoke"),
        {"vulnerability.count": 0},
        "config.vulnerability.count=0; must be an int >= 1",
        {"vulnerability.count": 2},
    ),
    (
        "vulnerability_layers",
        ("vulnerability", "smoke"),
        {"vulnerability.layers": "99"},
        "config.vulnerability.layers='99' but the model has 8 layers",
        {"vulnerability.layers": "7"},
    ),
]


def _check(config):
    """The job's checks alone (what runs before the warm start)."""
    if config.job == "vulnerability":
        from aqn_jax.jobs.vulnerability import check_study

        return check_study(config)
    from aqn_jax.checks import check_train

    return check_train(config)


@pytest.mark.parametrize("name,bad,message,good", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_in_one_line_writing_nothing(tmp_path, name, bad, message, good):
    from aqn_jax.launch import run

    work, cache = tmp_path / "run", tmp_path / "cache"
    work.mkdir()
    (work / "notes.txt").write_text("an earlier run's file")
    before = tree_state(work)
    config = _set(load_config(*name), **bad)
    config.sft.cache_dir = str(cache)
    with pytest.raises(ValueError) as e:
        run(config, str(work))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert tree_state(work) == before  # no config.json, no .lock
    assert not cache.exists()  # refused before the warm start
    # Negative control: the valid neighbour passes the same checks.
    _check(_set(load_config(*name), **good))


def test_a_late_format_check_is_one_line_from_the_command_line(tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    (work / "notes.txt").write_text("an earlier run's file")
    before = tree_state(work)
    proc = launch_cli(
        "--config=configs/base.py:smoke",
        "--config.faults.mx_scale_flip.enabled=True",
        "--config.faults.mx_scale_flip.count=1",
        "--config.faults.mx_scale_flip.block_size=7",
        f"--config.sft.cache_dir={tmp_path / 'cache'}",
        workdir=work,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "config.faults.mx_scale_flip.block_size=7: blocks of 7" in errors[0]
    assert "Traceback" not in proc.stderr
    assert tree_state(work) == before and not (tmp_path / "cache").exists()
