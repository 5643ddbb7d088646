"""Several hosts: two processes started by launch/local.py, joined by `jax.distributed` over
loopback (CPU collectives via gloo), one CPU device each, run the train job and agree exactly
with one process driving the same two-device mesh; config.distributed is checked up front."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from aqn_jax import parallel
from aqn_jax.checkpoint import Checkpointer

from conftest import SHALLOW_FLAGS, SHALLOW_LAYERS, launch_cli, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [
    "--config=configs/deadzone.py:smoke",
    *SHALLOW_FLAGS,  # 3 layers, the deadzone at the middle one (the session's smoke warm start)
    # All-zero rewards (the smoke SFT cannot solve the task yet) would leave only weight decay
    # to update the params; the entropy bonus gives every step a real, batch-wide gradient.
    "--config.algo.entropy_coeff=0.01",
    "--config.checkpoint.every=1",
    "--config.trainer.val_every=0",  # validation at the start and the end only
]


def _launch(workdir, cache, devices):
    out = launch_cli(
        *FLAGS,
        f"--config.sft.cache_dir={cache}",
        workdir=workdir,
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
    )
    assert out.returncode == 0, out.stderr[-3000:]


def _rows(workdir):
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in rows]


@pytest.mark.slow
def test_two_processes_agree_with_one(tmp_path, sft_cache):
    cache = sft_cache
    single, multi = tmp_path / "single", tmp_path / "multi"
    # The reference: one process, two devices (the same data=2 mesh), which also fills the
    # SFT cache (the session's: the smoke arms' warm start, one key) that both processes of the
    # multi-host run then read.
    _launch(single, cache, devices=2)

    # launch/local.py: two processes, one CPU device each, joined over loopback.
    proc = subprocess.run(
        [
            sys.executable,
            "launch/local.py",
            "--num_processes=2",
            "--",
            *FLAGS,
            f"--config.sft.cache_dir={cache}",
            f"--workdir={multi}",
        ],
        cwd=REPO,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    # Both processes ran; only process 0 writes the report.
    assert any(x.startswith("[p1] step 0: val acc") for x in lines)
    assert any(x.startswith("[p0] report:") for x in lines)
    assert not any(x.startswith("[p1] report:") for x in lines)

    assert _rows(multi) == _rows(single)
    rows = _rows(multi)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val-core/acc" in rows[2] and "val-core/acc" not in rows[1]
    assert rows[1]["faults/rollout/deadzone.flushed"] > 0 and rows[1]["actor/entropy"] > 0

    a, meta_a = Checkpointer(str(single), 0, 2).restore_host(2)
    b, meta_b = Checkpointer(str(multi), 0, 2).restore_host(2)
    assert meta_a == meta_b and meta_b["data"]["step"] == 2
    first, _ = Checkpointer(str(multi), 0, 2).restore_host(1)
    la, lb = jax.tree_util.tree_leaves(a["params"]), jax.tree_util.tree_leaves(b["params"])
    # Every leaf: the tied embedding, the final norm and 12 per decoder layer (q/k/v kernels and
    # biases, o, gate/up/down, two norms).
    assert len(la) == len(lb) == 2 + 12 * SHALLOW_LAYERS
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)
    moved = [
        np.abs(x - y).max()
        for x, y in zip(
            jax.tree_util.tree_leaves(first["params"]),
            lb,
            strict=True,
        )
    ]
    assert max(moved) > 1e-6  # step 2 really updated the params


def test_distributed_config_is_checked():
    dist = load_config("targeted").distributed
    parallel.check_distributed(dist)  # the default: one process
    assert parallel.initialize(dist) is False
    cases = {
        "coordinator": ("localhost", "expected 'host:port'"),
        "num_processes": (0, "must be >= 1"),
        "process_id": (2, "must be in [0, num_processes=2)"),
        "local_device_ids": ("0,a", "comma-separated integers"),
    }
    for field, (value, message) in cases.items():
        bad = load_config("targeted").distributed
        bad.coordinator, bad.num_processes, bad.process_id = "h:1", 2, 0
        bad[field] = value
        with pytest.raises(ValueError, match=rf"config\.distributed\.{field}="):
            parallel.check_distributed(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            parallel.check_distributed(bad)
    both = load_config("targeted").distributed
    both.auto, both.coordinator = True, "h:1"
    with pytest.raises(ValueError, match="give one"):
        parallel.check_distributed(both)


def test_to_host_and_put_batch_round_trip():
    mesh = parallel.make_mesh(load_config("targeted").mesh)
    x = np.arange(8 * len(mesh.devices.flat), dtype=np.float32).reshape(-1, 4)
    y = parallel.put_batch({"x": x, "s": np.float32(3)}, mesh)
    assert y["x"].sharding.spec[0] == parallel.BATCH_AXES
    np.testing.assert_array_equal(parallel.to_host(y["x"]), x)
    assert float(parallel.to_host(y["s"])) == 3.0
