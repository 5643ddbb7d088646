#!/usr/bin/env python3
"""N processes on this machine joined by jax.distributed over loopback: the multi-host code path
without a cluster (CPU collectives via gloo; or one GPU per process).

  python launch/local.py --num_processes=2 -- --config=configs/targeted.py:smoke \
      --workdir=runs/local2
  python launch/local.py --num_processes=2 --dry_run -- --config=configs/targeted.py

Each process gets --config.distributed.{coordinator,num_processes,process_id}; on CPU each has
--devices_per_process host devices (XLA_FLAGS), with --gpus_per_process it gets its own GPUs
(config.distributed.local_device_ids). Output lines are prefixed with the process id. If one
process fails the others are stopped; the exit status is the first failure's (0 if all pass).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import _common

GRACE_S = 30  # after a peer fails: SIGTERM (a final checkpoint), then SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(opts, args):
    port = opts.port or free_port()
    cmds = []
    for i in range(opts.num_processes):
        dist = [
            f"--config.distributed.coordinator=127.0.0.1:{port}",
            f"--config.distributed.num_processes={opts.num_processes}",
            f"--config.distributed.process_id={i}",
        ]
        env = {}
        if opts.gpus_per_process:
            g = opts.gpus_per_process
            dist.append(
                "--config.distributed.local_device_ids="
                + ",".join(str(i * g + j) for j in range(g))
            )
        else:
            env = {
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={opts.devices_per_process}",
            }
        cmds.append((_common.job_command(opts.python, args, dist), env))
    return cmds


def _pump(i, stream, out):
    for line in stream:
        out.write(f"[p{i}] {line}")
        out.flush()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mine, job = _common.split_argv(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument("--devices_per_process", type=int, default=1, help="CPU host devices each")
    p.add_argument("--gpus_per_process", type=int, default=0, help="GPUs each (0 = CPU)")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0 = a free one)")
    p.add_argument("--python", default=_common.default_python())
    p.add_argument("--dry_run", action="store_true", help="print the commands, start nothing")
    opts = p.parse_args(mine)
    if opts.num_processes < 1:
        p.error(f"--num_processes={opts.num_processes}; must be >= 1")
    if opts.devices_per_process < 1:
        p.error(f"--devices_per_process={opts.devices_per_process}; must be >= 1")
    args = _common.job_args(p, job)
    cmds = commands(opts, args)
    if opts.dry_run:
        for cmd, env in cmds:
            print(_common.show(cmd, env))
        return 0
    procs, pumps = [], []
    for i, (cmd, env) in enumerate(cmds):
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        t = threading.Thread(target=_pump, args=(i, proc.stdout, sys.stdout), daemon=True)
        t.start()
        procs.append(proc)
        pumps.append(t)
    status, failed_at = 0, None
    try:
        pending = list(procs)
        while pending:
            for proc in list(pending):
                try:
                    rc = proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                pending.remove(proc)
                if rc and not status:
                    status, failed_at = rc, time.monotonic()
                    for other in pending:  # a peer died: the rest would wait in a collective
                        other.send_signal(signal.SIGTERM)
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for other in pending:
                    other.kill()
    except KeyboardInterrupt:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        status = 130
    for t in pumps:
        t.join(timeout=5)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
