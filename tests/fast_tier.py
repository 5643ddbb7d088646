"""The fast tier touches every module (issue 53): from coverage data of `pytest -m "not slow"`,
each file under aqn_jax/ is imported and at least one of its functions runs (a line inside a
function body, which importing the module never executes). A module without functions (only
constants or re-exports) needs only to be imported; an empty one nothing.

    python tests/fast_tier.py                 # the fast tier under coverage, then the check
    python tests/fast_tier.py --data=FILE     # only the check, on a combined coverage data file

Exit 0 and one line when every module is touched; else 1 and one line per module that is not
("imported only" or "never imported"). The run uses pyproject.toml's [tool.coverage.run]
(source aqn_jax, parallel data files, subprocesses measured too: the CLI tests' launches).
"""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aqn_jax"
FAST_TIER = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-m", "not slow", "tests"]


def body_lines(source: str) -> tuple[set[int], bool]:
    """(every line that a statement inside a function body spans, whether the module has any
    statement at all). A def line, its decorators and defaults run at import; the body never."""
    tree = ast.parse(source)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            body = node.body if isinstance(node.body, list) else [node.body]
            for stmt in body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines, bool(tree.body)


def untouched(executed: dict[str, set[int]], package: pathlib.Path = PACKAGE) -> list[str]:
    """The modules under `package` the run did not touch, one 'path: why' each. `executed` maps
    a file's absolute path to the line numbers that ran in it (coverage's `lines`)."""
    missing = []
    for path in sorted(package.rglob("*.py")):
        body, has_code = body_lines(path.read_text())
        ran = executed.get(str(path.resolve()))
        rel = path.relative_to(package.parent)
        if not has_code:
            continue
        if not ran:
            missing.append(f"{rel}: never imported")
        elif body and not ran & body:
            missing.append(f"{rel}: imported only (none of its {len(body)} function lines ran)")
    return missing


def executed_lines(data_file: str) -> dict[str, set[int]]:
    import coverage

    data = coverage.CoverageData(basename=data_file)
    data.read()
    return {os.path.realpath(f): set(data.lines(f) or ()) for f in data.measured_files()}


def run_fast_tier(data_file: str) -> int:
    """The fast tier under coverage (parallel data files, subprocesses measured), combined into
    `data_file`; pytest's exit code."""
    env = dict(os.environ, COVERAGE_FILE=data_file)
    rc = subprocess.call([sys.executable, "-m", "coverage", "run", *FAST_TIER], cwd=ROOT, env=env)
    subprocess.check_call([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT, env=env)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a combined coverage data file (default: run the tier)")
    args = parser.parse_args(argv)
    data_file = args.data
    if data_file is None:
        data_file = os.path.join(tempfile.mkdtemp(prefix="fast_tier_cov_"), ".coverage")
        rc = run_fast_tier(data_file)
        if rc != 0:
            print(f"the fast tier failed (pytest exit {rc}); the coverage check still follows")
    else:
        rc = 0
    missing = untouched(executed_lines(data_file))
    for line in missing:
        print(line)
    total = len(list(PACKAGE.rglob("*.py")))
    if missing:
        print(f"{len(missing)} of {total} modules under aqn_jax/ not exercised by the fast tier")
        return 1
    print(f"all {total} modules under aqn_jax/ imported and exercised by the fast tier")
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
