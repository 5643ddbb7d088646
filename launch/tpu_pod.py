#!/usr/bin/env python3
"""One run on every worker of a Cloud TPU pod slice (TPU VMs): the same command on all workers
over `gcloud ... ssh --worker=all`; JAX finds the coordinator and the process ids itself
(config.distributed.auto=True).

  python launch/tpu_pod.py --tpu=my-v5p-64 --zone=us-east5-a --install -- \
      --config=configs/gsm8k_qwen2p5_1p5b.py:targeted \
      --config.model.hf_path=/mnt/models/Qwen2.5-1.5B-Instruct \
      --config.data.train_path=/mnt/data/train.parquet \
      --config.data.test_path=/mnt/data/test.parquet --workdir=gs://bucket/runs/targeted
  python launch/tpu_pod.py --tpu=my-v5p-64 --zone=us-east5-a --dry_run -- --config=...

The repository must already be on every worker at --repo_dir (e.g. cloned by a startup
script); --install first runs `pip install -e .[tpu]`-style setup there. The workdir must be
shared (a GCS bucket or a mounted filesystem): checkpoints are written collectively.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys

import _common


def commands(opts, args) -> list[list[str]]:
    base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", opts.tpu, f"--zone={opts.zone}"]
    if opts.project:
        base.append(f"--project={opts.project}")
    base.append("--worker=all")
    repo = opts.repo_dir
    # '~/x' must reach the worker's shell unquoted so that it expands there.
    cd = "cd ~/" + shlex.quote(repo[2:]) if repo.startswith("~/") else "cd " + shlex.quote(repo)
    out = []
    if opts.install:
        install = f"{cd} && {opts.python} -m pip install -q -e . 'jax[tpu]'"
        out.append([*base, f"--command={install}"])
    job = shlex.join(_common.job_command(opts.python, args, ["--config.distributed.auto=True"]))
    out.append([*base, f"--command={cd} && {job}"])
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mine, job = _common.split_argv(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tpu", required=True, help="TPU VM (pod slice) name")
    p.add_argument("--zone", required=True)
    p.add_argument("--project", default="")
    p.add_argument("--repo_dir", default="~/aqn_jax", help="the repository on every worker")
    p.add_argument("--python", default="python3")
    p.add_argument("--install", action="store_true", help="pip install on every worker first")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    opts = p.parse_args(mine)
    cmds = commands(opts, _common.job_args(p, job))
    if opts.dry_run:
        for cmd in cmds:
            print(shlex.join(cmd))
        return 0
    if shutil.which("gcloud") is None:
        p.error("gcloud not found: install the Google Cloud CLI (or use --dry_run)")
    for cmd in cmds:
        rc = subprocess.call(cmd)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
