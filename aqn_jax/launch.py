"""Entry point of every job.

  python -m aqn_jax.launch --config=configs/<name>.py [--config.a.b=v] [--workdir=DIR]

Parses the ml_collections config, logs the devices, and hands over to
`aqn_jax.jobs.<config.job>.run(config, workdir)`. Nothing else lives here.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import pkgutil
import re
import signal
import sys

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from aqn_jax import compile_cache, compute_dtype, jobs
from aqn_jax.lock import LOCK_FILE, WorkdirLock

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (results, checkpoints). Default: runs/<config file stem>."
)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Show the traceback of a configuration error (ValueError) too."
)
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache",
    None,
    "Persistent XLA compilation cache directory, or 'off'. Default: $JAX_COMPILATION_CACHE_DIR"
    f" if set, else {compile_cache.default_dir()}.",
)


def available_jobs() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(jobs.__path__) if not m.name.startswith("_"))


def resolve_dtype(config, log=print) -> None:
    """Replace `config.model.dtype='auto'` by the chosen dtype, in place (config.json records
    it: a run resumes with what it chose). A config without the field is left as it is."""
    model = config.get("model")
    if model is None or model.get("dtype") != compute_dtype.AUTO:
        return
    model.dtype = compute_dtype.resolve(model.dtype, log)  # an existing field: allowed locked


def run(config, workdir: str) -> None:
    job = config.get("job")
    if job not in available_jobs():
        raise ValueError(f"config.job={job!r}; allowed: {available_jobs()}")
    if "distributed" in config:  # several hosts: before anything else touches the devices
        from aqn_jax import parallel

        if parallel.initialize(config.distributed):
            logging.info(
                "process %d of %d (%d local devices)",
                jax.process_index(),
                jax.process_count(),
                jax.local_device_count(),
            )
    logging.info("JAX %s, %d devices: %s", jax.__version__, jax.device_count(), jax.devices())
    jobs.check_required(config)  # every job: a config's empty local paths, before any work
    resolve_dtype(config)  # config.model.dtype='auto': bf16 where it is faster here
    module = importlib.import_module(f"aqn_jax.jobs.{job}")
    created = open_workdir(workdir)
    if jax.process_index() != 0:  # several hosts: process 0 holds the workdir for all
        module.run(config, workdir)
        return
    had_lock = os.path.exists(os.path.join(workdir, LOCK_FILE))
    try:
        with WorkdirLock(workdir) as lock:  # a busy workdir refuses here, naming the holder
            try:
                module.run(config, workdir)
            except ValueError:  # refused: the workdir as it was found (its jobs check first)
                if not had_lock:
                    lock.discard()
                raise
    except ValueError:
        _remove_empty(workdir, created)  # the directories it made for the refused command
        raise


def open_workdir(workdir: str) -> list[str]:
    """Create `workdir` (and its parents); returns the directories it created, deepest first. A
    path that is a file, or that cannot be created or written, is a one-line ValueError naming
    --workdir."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir}: is a file, not a directory; choose another path")
    created, path = [], os.path.abspath(workdir)
    while not os.path.exists(path):
        created.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--workdir={workdir}: cannot be created ({e.strerror}: {e.filename}); choose a"
            " writable path"
        ) from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise ValueError(f"--workdir={workdir}: not writable by this user; choose another path")
    return created


@contextlib.contextmanager
def sigterm_exits_143():
    """SIGTERM (Slurm preemption, scancel, timeout) anywhere in a job: exit 143 through the job's
    cleanup (`finally`: the workdir lock, pending checkpoint saves) rather than die on the spot.
    The train loop and the compare job put their own handlers over this one while they run
    (save after the current step / tell the workers), and give it back."""

    def handler(signum, frame):
        raise SystemExit(143)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (a test runner's worker): no handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_now_if_abandoned(code) -> None:
    """After a SIGTERM abandoned a compile running in a thread (`checkpoint.ABANDONED`), the job
    having cleaned up (the lock released, the writers closed): end the process now, not after
    XLA finishes the compile, and not inside the interpreter's teardown with it running."""
    from aqn_jax.checkpoint import ABANDONED

    if ABANDONED.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 143)


def _remove_empty(workdir: str, created: list[str]) -> None:
    """Remove the directories `open_workdir` created, deepest first, while they are empty."""
    for path in created:
        try:
            os.rmdir(path)
        except OSError:
            return


def _setup_process() -> None:
    """Before anything compiles: the persistent compilation cache (`--compile_cache`), and third-
    party logs (Orbax's checkpoint manager, absl, jax) at WARNING unless `--verbosity` is given
    (absl would otherwise lower it to INFO after parsing)."""
    compile_cache.use(compile_cache.resolve(_COMPILE_CACHE.value))
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def _user_error(message: str) -> None:
    """A user error: `error: <message>` on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _unknown_field(argv) -> str | None:
    """The first `--config.<path>` override that names no field of the config, as a message
    with the nearest field (ml_collections raises a KeyError / AttributeError for it while absl
    parses the flags), or None when every override names a field."""
    spec = next((a.split("=", 1)[1] for a in argv if re.match(r"^--?config=", a)), None)
    if spec is None:
        return None
    try:
        config = flags.FLAGS["config"].parser.parse(spec)  # the file loaded again, no override
    except Exception:  # the config file itself fails: absl reports that
        return None
    for arg in argv:
        m = re.match(r"^(--?(?:no)?config\.)([^=]+)", arg)
        if not m:
            continue
        flag, parts, node = m.group(0), m.group(2).split("."), config
        for i, part in enumerate(parts):
            where = ".".join(["config", *parts[:i]])
            if not isinstance(node, ml_collections.ConfigDict):
                kind = type(node).__name__
                return f"{flag}: no such field; {where} is a value ({kind}), not a section"
            if part in node:
                node = node[part]
                continue
            near = difflib.get_close_matches(part, list(node.keys()), n=1, cutoff=0.6)
            if near:
                guess = ".".join([where, near[0], *parts[i + 1 :]])
                return f"{flag}: no such field; did you mean {guess}?"
            return f"{flag}: no such field; {where} has: {', '.join(sorted(node.keys()))}"
    return None


def _after_overrides(config) -> None:
    """`experiment.after_overrides` of the command line's `--config.<field>` values: a
    config.study_fault given moves the arm's fault (apply_arm's switch) to the kind it names; a
    config.arm given that differs from the config's is refused. Before anything is written."""
    flag = flags.FLAGS["config"]
    overrides = config_flags.get_override_values(flag)
    if not {"arm", "study_fault"} & set(overrides):
        return
    from aqn_jax.experiment import after_overrides

    built = flag.parser.parse(config_flags.get_config_filename(flag))  # without the overrides
    after_overrides(config, built, overrides)


def _verbose(argv) -> bool:
    """--verbose on the command line (the flag itself is not parsed when parsing fails)."""
    return any(re.fullmatch(r"--?verbose(=(1|t|true|True))?", a) for a in argv)


def _parse_flags(argv):
    """absl's flag parsing, a bad flag reported as a user error (one line, exit 2): an unknown
    flag or a value of the wrong type (absl's message), an override of a field the config does
    not have (ml_collections raises it as a KeyError / AttributeError with a traceback)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        if _verbose(argv):
            raise
        message = str(e)
        if "Traceback (most recent call last)" in message:  # the config file's get_config raised
            lines = [line for line in message.splitlines() if line.strip()]
            message = f"{message.split(': Error whilst', 1)[0]}: {lines[-1].strip()}"
        _user_error(" ".join(message.split()))
    except (KeyError, AttributeError):
        message = _unknown_field(argv)
        if message is None or _verbose(argv):
            raise
        _user_error(message)


def main(argv=None) -> None:
    def _main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}", exitcode=2)
        if _CONFIG.value is None:
            raise app.UsageError("--config=configs/<name>.py is required", exitcode=2)
        try:  # a config file that failed to load raises on first use (ml_collections)
            _CONFIG.value.get("job")
        except OSError as e:
            if _VERBOSE.value:
                raise
            cause = str(e.__cause__ or e).strip().splitlines()[-1].strip()
            name = config_flags.get_config_filename(flags.FLAGS["config"])
            _user_error(f"--config={name}: cannot load it: {cause}")
        try:  # the fields get_config derived others from, as the command line set them
            _after_overrides(_CONFIG.value)
        except ValueError as e:
            if _VERBOSE.value:
                raise
            _user_error(str(e))
        workdir = _WORKDIR.value
        if not workdir:
            stem = os.path.splitext(
                os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"]))
            )[0]
            workdir = os.path.join("runs", stem.split(":")[0])
        try:
            _setup_process()
            with sigterm_exits_143():
                run(_CONFIG.value, workdir)
        except SystemExit as e:
            _exit_now_if_abandoned(e.code)
            raise
        except ValueError as e:
            # A user error (every check raises ValueError naming the field, the value and what
            # is allowed): its message, exit 2. Other exceptions are bugs: their traceback.
            if _VERBOSE.value:
                raise
            _user_error(str(e))

    app.run(_main, argv=argv, flags_parser=_parse_flags)


if __name__ == "__main__":
    main()
