"""tests/fast_tier.py, the fast tier's coverage check (issue 53), on a small package measured by
coverage for real: a module whose function ran passes; one only imported, one never imported
are named; a module of constants needs only its import, an empty one nothing."""

import os
import subprocess
import sys

import fast_tier

MODULES = {
    "ran.py": "X = 1\n\n\ndef f(a):\n    b = a + 1\n    return b\n",
    "imported.py": (
        "import os\n\n\n@staticmethod\ndef g(a=os.sep):\n    return (\n        a\n    )\n"
    ),
    "constants.py": "Y = [1,\n     2]\n",
    "unimported.py": "Z = 3\n\n\ndef h():\n    return Z\n",
    "empty.py": '"""Only a docstring is code; an empty file has none."""\n',
    "blank.py": "",
}


def test_fast_tier_check_names_modules_only_imported_or_never(tmp_path):
    pkg = tmp_path / "fasttier_pkg"
    pkg.mkdir()
    for name, text in MODULES.items():
        (pkg / name).write_text(text)
    data = str(tmp_path / ".coverage")
    # Measured in a process of its own: a second Coverage started inside a test would stop the
    # measurement of tests/fast_tier.py's own run in this worker. config_file=False: not
    # pyproject.toml's [tool.coverage.run] (parallel data files); no COVERAGE_* variables, so
    # the outer run's subprocess hook stays out of it.
    script = (
        "import importlib, coverage\n"
        f"cov = coverage.Coverage(data_file={data!r}, source=[{str(pkg)!r}], config_file=False)\n"
        "cov.start()\n"
        "assert importlib.import_module('fasttier_pkg.ran').f(1) == 2\n"
        "for name in ('imported', 'constants', 'empty'):\n"
        "    importlib.import_module('fasttier_pkg.' + name)\n"
        "cov.stop()\n"
        "cov.save()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True)
    executed = fast_tier.executed_lines(data)
    assert executed[str((pkg / "ran.py").resolve())] >= {1, 4, 5, 6}
    assert fast_tier.untouched(executed, pkg) == [
        "fasttier_pkg/imported.py: imported only (none of its 3 function lines ran)",
        "fasttier_pkg/unimported.py: never imported",
    ]
    # The function bodies' lines: every line of a multi-line statement, never the def line.
    assert fast_tier.body_lines(MODULES["imported.py"]) == ({6, 7, 8}, True)
    assert fast_tier.body_lines(MODULES["blank.py"]) == (set(), False)
    # Negative control: once g has run too, only the never-imported module is left.
    executed[str((pkg / "imported.py").resolve())].add(7)
    assert fast_tier.untouched(executed, pkg) == ["fasttier_pkg/unimported.py: never imported"]


def test_fast_tier_check_sees_every_module_of_the_package():
    """Each file under aqn_jax/ is either checked for a function line or is an import-only
    module; nothing is skipped because its source failed to parse."""
    files = sorted(fast_tier.PACKAGE.rglob("*.py"))
    assert len(files) >= 70
    with_functions = [f for f in files if fast_tier.body_lines(f.read_text())[0]]
    assert fast_tier.PACKAGE / "forward.py" in with_functions
    assert len(with_functions) >= 60
    # Nothing ran: every module with code is named, none left out.
    named = fast_tier.untouched({})
    coded = [f for f in files if fast_tier.body_lines(f.read_text())[1]]
    assert len(named) == len(coded) and all(x.endswith("never imported") for x in named)
