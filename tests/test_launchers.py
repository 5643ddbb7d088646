"""launch/: the local, Slurm and TPU-pod launchers print exactly what they would run
(--dry_run); the Slurm script is valid bash; bad launcher input is refused."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--", "--config=configs/targeted.py", "--workdir=/shared/runs/t"]


def launcher(name, *args):
    return subprocess.run(
        [sys.executable, f"launch/{name}.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_local_dry_run_lists_one_command_per_process():
    out = launcher("local", "--num_processes=3", "--devices_per_process=2", "--dry_run", *JOB)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    coordinators = set()
    for i, line in enumerate(lines):
        assert "-m aqn_jax.launch --config=configs/targeted.py --workdir=/shared/runs/t" in line
        assert f"--config.distributed.process_id={i}" in line
        assert "--config.distributed.num_processes=3" in line
        assert "--xla_force_host_platform_device_count=2" in line
        coordinators.add(re.search(r"coordinator=(127\.0\.0\.1:\d+)", line).group(1))
    assert len(coordinators) == 1  # every process joins the same coordinator


def test_local_gives_each_process_its_own_gpus():
    out = launcher("local", "--num_processes=2", "--gpus_per_process=4", "--dry_run", *JOB)
    lines = out.stdout.strip().splitlines()
    assert "--config.distributed.local_device_ids=0,1,2,3" in lines[0]
    assert "--config.distributed.local_device_ids=4,5,6,7" in lines[1]
    assert "XLA_FLAGS" not in out.stdout


def test_slurm_script(tmp_path):
    out = launcher(
        "slurm",
        "--nodes=4",
        "--gpus_per_node=8",
        "--partition=a100",
        "--requeue",
        "--dry_run",
        *JOB,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=a100",
        "#SBATCH --requeue",
        "#SBATCH --signal=TERM@300",
    ):
        assert line in text.splitlines(), line
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    # Rank and world size are read on each node (inside the single-quoted bash -c).
    assert "bash -c 'python -m aqn_jax.launch --config=configs/targeted.py" in text
    assert '--config.distributed.process_id="$SLURM_PROCID"' in text
    assert '--config.distributed.num_processes="$SLURM_NTASKS"' in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_tpu_pod_commands():
    out = launcher("tpu_pod", "--tpu=pod", "--zone=us-east5-a", "--install", "--dry_run", *JOB)
    assert out.returncode == 0, out.stderr
    install, run = out.stdout.strip().splitlines()
    for line in (install, run):
        assert line.startswith("gcloud compute tpus tpu-vm ssh pod --zone=us-east5-a")
        assert "--worker=all" in line and "cd ~/aqn_jax" in line
    assert "pip install" in install
    assert "aqn_jax.launch --config=configs/targeted.py" in run
    assert "--config.distributed.auto=True" in run


@pytest.mark.parametrize(
    "name,args,message",
    [
        ("local", ["--dry_run", "--", "--workdir=x"], "give the job after '--'"),
        ("local", ["--num_processes=0", "--dry_run", *JOB], "--num_processes=0; must be >= 1"),
        (
            "slurm",
            ["--dry_run", *JOB, "--config.distributed.process_id=1"],
            "--config.distributed.* is set by the launcher",
        ),
        ("slurm", ["--nodes=0", "--dry_run", *JOB], "--nodes=0; must be >= 1"),
        ("tpu_pod", ["--zone=z", "--dry_run", *JOB], "--tpu"),
    ],
)
def test_bad_launcher_input(name, args, message):
    out = launcher(name, *args)
    assert out.returncode == 2
    assert message in out.stderr
