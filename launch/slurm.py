#!/usr/bin/env python3
"""One run over several Slurm GPU nodes: an sbatch script with one task per node; every task runs
the same job, joined by jax.distributed with the first node of the allocation as coordinator.

  python launch/slurm.py --nodes=2 --gpus_per_node=8 --partition=a100 --time=12:00:00 -- \
      --config=configs/gsm8k_qwen2p5_1p5b.py:targeted \
      --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \
      --config.data.train_path=/data/gsm8k/train.parquet \
      --config.data.test_path=/data/gsm8k/test.parquet --workdir=/shared/runs/targeted
  python launch/slurm.py --nodes=2 --dry_run -- --config=...   # print the script only

The workdir must be on storage every node sees (checkpoints are written collectively). A
preempted job gets SIGTERM (--signal) and saves a final checkpoint; resubmitting the same
command resumes from it (--requeue lets Slurm do that itself).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import _common

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
#SBATCH --signal=TERM@{grace}
#SBATCH --output={log_dir}/%x-%j.out
{extra}
set -euo pipefail
cd {repo}
# The coordinator: the first node of the allocation (process 0).
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export AQN_COORDINATOR="$head:{port}"
# One task per node; each task learns its rank from Slurm (evaluated on the node).
srun --kill-on-bad-exit=1 bash -c '{command} \\
  --config.distributed.coordinator="$AQN_COORDINATOR" \\
  --config.distributed.num_processes="$SLURM_NTASKS" \\
  --config.distributed.process_id="$SLURM_PROCID"'
"""


def script(opts, args) -> str:
    extra = []
    if opts.partition:
        extra.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        extra.append(f"#SBATCH --account={opts.account}")
    if opts.requeue:
        extra.append("#SBATCH --requeue")
    command = shlex.join(_common.job_command(opts.python, args, []))
    if "'" in command:
        raise SystemExit(
            f"job arguments must not contain single quotes (they are wrapped in bash -c '...'):"
            f" {command}"
        )
    return TEMPLATE.format(
        job_name=opts.job_name,
        nodes=opts.nodes,
        gpus=opts.gpus_per_node,
        cpus=opts.cpus_per_task,
        time=opts.time,
        grace=opts.grace_s,
        log_dir=opts.log_dir,
        extra="\n".join(extra),
        repo=shlex.quote(os.path.abspath(opts.repo)),
        port=opts.port,
        command=command,
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mine, job = _common.split_argv(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--cpus_per_task", type=int, default=16)
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--job_name", default="aqn_jax")
    p.add_argument("--port", type=int, default=29500, help="coordinator port on the first node")
    p.add_argument("--grace_s", type=int, default=300, help="SIGTERM this long before the end")
    p.add_argument("--requeue", action="store_true", help="let Slurm requeue a preempted job")
    p.add_argument("--log_dir", default="slurm_logs")
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--python", default="python")
    p.add_argument("--dry_run", action="store_true", help="print the sbatch script, submit nothing")
    opts = p.parse_args(mine)
    for field in ("nodes", "gpus_per_node", "cpus_per_task"):
        if getattr(opts, field) < 1:
            p.error(f"--{field}={getattr(opts, field)}; must be >= 1")
    text = script(opts, _common.job_args(p, job))
    if opts.dry_run:
        print(text, end="")
        return 0
    if shutil.which("sbatch") is None:
        p.error("sbatch not found: run this on a Slurm login node (or use --dry_run)")
    os.makedirs(opts.log_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(text)
    print(f"submitting {f.name}")
    return subprocess.call(["sbatch", f.name])


if __name__ == "__main__":
    raise SystemExit(main())
