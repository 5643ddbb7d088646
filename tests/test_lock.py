"""One process per workdir: a second run refuses at once naming the holder; a killed holder's
lock is taken over."""

import os
import signal
import subprocess
import sys
import time

import pytest

from aqn_jax.lock import WorkdirBusy, WorkdirLock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = (
    "import sys, time; from aqn_jax.lock import WorkdirLock; "
    "l = WorkdirLock(sys.argv[1]); l.acquire(); print('locked', flush=True); time.sleep(600)"
)


def _holder(workdir):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_second_process_refuses_then_takes_over_a_killed_holder(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(WorkdirBusy, match=rf"in use by pid {proc.pid} on \S+ since 20"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = WorkdirLock(str(tmp_path))
    previous = lock.acquire()  # the kernel dropped the dead holder's lock: taken over
    assert previous["pid"] == proc.pid
    lock.release()
    # A clean release leaves no holder: the next run finds nothing to take over.
    lock = WorkdirLock(str(tmp_path))
    assert lock.acquire() is None
    lock.release()


def test_launch_on_a_busy_workdir_exits_2_before_any_work(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = _holder(work)
    try:
        t0 = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "aqn_jax.launch",
                "--config=configs/targeted.py:smoke",
                f"--config.sft.cache_dir={tmp_path / 'cache'}",
                f"--workdir={work}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"in use by pid {proc.pid}" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    # Nothing ran: no SFT cache, no checkpoint, the existing rows untouched.
    assert not (tmp_path / "cache").exists()
    assert sorted(p.name for p in work.iterdir()) == [".lock", "metrics.jsonl"]
    assert (work / "metrics.jsonl").read_text() == '{"step": 0}\n'
    print(f"refused in {wall:.1f} s")


@pytest.mark.slow
def test_sigterm_exits_143_through_the_jobs_cleanup():
    """SIGTERM anywhere in a job (Slurm preemption, scancel, timeout) raises SystemExit(143) in
    it, so its `finally` blocks run (the workdir lock, pending checkpoint saves) where the
    default action killed the process on the spot; the handler is given back afterwards."""
    from aqn_jax.launch import sigterm_exits_143

    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(SystemExit) as stop, sigterm_exits_143():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted: the handler runs at the next bytecode
        finally:
            cleaned.append(True)
    assert stop.value.code == 143 and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before
