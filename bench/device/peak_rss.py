"""Run a command, poll the RSS of its process tree, and write the peak (device section B).

  python bench/device/peak_rss.py --timeout 300 --log L --out R.json -- CMD ...

Peak = the largest summed RSS of the command and its descendants seen by polling every 0.2 s
(psutil), and the kernel's ru_maxrss of the largest waited-for child (os.wait4: counts a child
killed at the timeout too). At the timeout the process group gets SIGTERM, then SIGKILL 10 s
later. The JSON also holds the planner's 'CPU process RSS' line and the last log lines (which
phase was reached) and, with --workdir, how many metrics rows and RL steps the run wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import time

import psutil

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default=None, help="the run's workdir: its metrics say how far")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    t0 = time.perf_counter()
    with open(a.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    root = psutil.Process(proc.pid)
    peak, peak_at, timed_out, status, ru = 0, 0.0, False, None, None
    killed_at = None
    while status is None:
        try:
            rss = root.memory_info().rss
            for c in root.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    rss += c.memory_info().rss
        except psutil.Error:
            rss = 0
        if rss > peak:
            peak, peak_at = rss, time.perf_counter() - t0
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status = st
            break
        now = time.perf_counter() - t0
        if now > a.timeout and killed_at is None:
            timed_out, killed_at = True, now
            os.killpg(proc.pid, signal.SIGTERM)
        elif killed_at is not None and now > killed_at + 10:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    with open(a.log, errors="replace") as f:
        text = f.read()
    planner = [ln.strip() for ln in text.splitlines() if "RSS" in ln or "GiB" in ln][:12]
    est = re.search(r"CPU process RSS\s+([\d.]+)", text)
    result = {
        "cmd": cmd,
        "wall_s": time.perf_counter() - t0,
        "timed_out": timed_out,
        "returncode": os.waitstatus_to_exitcode(status),
        "peak_rss_polled_gib": peak / GIB,
        "peak_rss_polled_at_s": peak_at,
        "ru_maxrss_gib": ru.ru_maxrss * 1024 / GIB if ru else None,
        "planner_cpu_rss_gib": float(est.group(1)) if est else None,
        "planner_lines": planner,
        "log_tail": text.splitlines()[-15:],
    }
    metrics = os.path.join(a.workdir or "", "metrics.jsonl")
    if a.workdir and os.path.isfile(metrics):
        with open(metrics) as f:
            rows = [json.loads(x) for x in f if x.strip()]
        result["metrics_rows"] = len(rows)
        result["rl_steps_done"] = sum("timing_s/step" in r for r in rows)
        result["last_row"] = rows[-1] if rows else None
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
