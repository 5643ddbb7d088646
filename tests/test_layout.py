"""docs/ARCHITECTURE.md's layering, checked on the source: a job never imports another job, and
no config or library module imports a job, and only the launcher runs one. And the house is
written down in the repo: every file docs/ARCHITECTURE.md names exists, and the code cites it,
not design notes outside the repository."""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = {n[:-3] for n in os.listdir(os.path.join(REPO, "aqn_jax", "jobs")) if n[0] != "_"}


def job_imports(source: str) -> list[str]:
    """The imports of a job module in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            if node.module.startswith("aqn_jax.jobs."):
                found.append(node.module)
            elif node.module == "aqn_jax.jobs" and set(names) & JOBS:
                found.append(f"aqn_jax.jobs: {sorted(set(names) & JOBS)}")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("aqn_jax.jobs.")]
    return found


def test_no_job_config_or_library_module_imports_a_job():
    assert {"train", "pretrain", "compare", "evaluate"} <= JOBS
    bad = {}
    for folder in ("aqn_jax", "configs"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                path = os.path.join(root, name)
                # launch.py is the entry point: it dispatches to the jobs.
                if name.endswith(".py") and path != os.path.join(REPO, "aqn_jax", "launch.py"):
                    with open(path) as f:
                        if found := job_imports(f.read()):
                            bad[os.path.relpath(path, REPO)] = found
    assert bad == {}


def test_the_check_sees_a_job_import():
    """The negative control: the imports this layout forbids are found."""
    source = "from aqn_jax.jobs import check_required, train\nimport aqn_jax.jobs.pretrain\n"
    assert job_imports(source) == ["aqn_jax.jobs: ['train']", "aqn_jax.jobs.pretrain"]
    assert job_imports("from aqn_jax.jobs import check_required\n") == []


def runs_a_job(source: str) -> bool:
    """Whether `source` imports a job module by name at run time (`importlib.import_module` of
    `aqn_jax.jobs.<name>`), which the import checks above cannot see."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr) and arg.values:
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("aqn_jax.jobs"):
                return True
    return False


def test_only_the_launcher_runs_a_job():
    """A job never drives another job: compare's runs are library calls (`training.run`)."""
    users = []
    for folder in ("aqn_jax", "configs"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(root, name)) as f:
                        if runs_a_job(f.read()):
                            users.append(os.path.relpath(os.path.join(root, name), REPO))
    assert users == [os.path.join("aqn_jax", "launch.py")]
    # The negative control: the check sees the dispatch it forbids, in both spellings.
    assert runs_a_job('importlib.import_module(f"aqn_jax.jobs.{config.job}")\n')
    assert runs_a_job('importlib.import_module("aqn_jax.jobs.train")\n')
    assert not runs_a_job('importlib.import_module(f"aqn_jax.models.{name}")\n')


ARCHITECTURE = os.path.join(REPO, "docs", "ARCHITECTURE.md")
# A path of the repository as docs/ARCHITECTURE.md writes one: from a top-level folder, not
# inside a longer word or path; `<name>` marks a placeholder (a recipe's new file).
REPO_PATH = re.compile(r"(?<![\w/.-])((?:aqn_jax|configs|tests|bench|launch|docs)/[\w./<>-]*)")
# A citation of a document a clone does not have: the original system's notes (DESIGN.md,
# REFERENCE.md, "the design notes", "seed 002"), a tracker's issue ("issue 59"), a path outside
# the checkout ("../shared/seeds"). Words may break across lines.
OUTSIDE_NOTES = re.compile(
    r"\b(?:DESIGN|REFERENCE)\.md|\b(?:design|seed|original)\s+notes\b|\bthe\s+notes'"
    r"|\bseeds?\s+`?0\d\d\b|\bissues?\s+#?\d+"
    r"|(?:\.\./|\b)shared/(?:seeds|datasets|REFERENCE|STYLE|hooks)\b",
    re.IGNORECASE,
)


def named_paths(text: str) -> list[str]:
    """The repository paths `text` names (files, or folders ending in '/'), placeholders out."""
    paths = (m.rstrip(".,;:") for m in REPO_PATH.findall(text))
    return sorted({p for p in paths if "<" not in p})


def test_every_path_the_architecture_names_exists():
    with open(ARCHITECTURE) as f:
        paths = named_paths(f.read())
    assert len(paths) > 50  # the layers table alone names every room
    assert [p for p in paths if not os.path.exists(os.path.join(REPO, p))] == []
    # The negative control: a placeholder is left out, a missing file is seen.
    assert named_paths("`aqn_jax/jobs/<name>.py`, `aqn_jax/nowhere.py`.") == ["aqn_jax/nowhere.py"]


def outside_citations(text: str) -> list[tuple[int, str]]:
    """(line, words) of each citation of a document outside the repository in `text`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in OUTSIDE_NOTES.finditer(text)]


def cited_files() -> list[str]:
    """The files whose citations must stay inside the repository: aqn_jax/, configs/, README.md."""
    paths = [os.path.join(REPO, "README.md")]
    for folder in ("aqn_jax", "configs"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            paths += [os.path.join(root, n) for n in files if n.endswith((".py", ".md", ".txt"))]
    return sorted(paths)


def test_the_code_cites_the_architecture_not_notes_outside_the_repo():
    """The design and reference facts the code relies on are in docs/ARCHITECTURE.md (and the
    results in docs/): no file under aqn_jax/ or configs/, nor README.md, cites the original
    system's notes, a tracker's issue or a path outside the checkout, which a clone does not
    have."""
    paths = cited_files()
    assert len(paths) > 100 and os.path.join(REPO, "aqn_jax", "experiment.py") in paths
    bad = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            found = outside_citations(f.read())
        bad += [f"{os.path.relpath(path, REPO)}:{i}: {w}" for i, w in found]
    assert bad == []
    # The negative control: each kind of citation is found, also across a line break, and the
    # project's own docs, a public tracker's issue and a run's seed number are not.
    planted = (
        "(see shared/REFERENCE.md)\n"
        "the original design\n    notes' metric; seeds 002/003; seed 001's table\n"
        "(WORKSPACE.md, issue 32); read `../shared/datasets/gsm8k`\n"
    )
    assert outside_citations(planted) == [
        (1, "shared/REFERENCE"),
        (2, "design\n    notes"),
        (3, "seeds 002"),
        (3, "seed 001"),
        (4, "issue 32"),
        (4, "../shared/datasets"),
    ]
    own = "(docs/ARCHITECTURE.md, decision 2; NVlabs/QeRL#14; seed 3; the study uses seeds 0-4)"
    assert outside_citations(own) == []


def bench_map_names(text: str) -> set[str]:
    """The scripts the benches map of docs/ARCHITECTURE.md (`text`) names: its backticked
    bare names, from "**The benches**" to the next paragraph that starts in bold."""
    section = text.split("**The benches**", 1)[1].split("\n\n**", 1)[0]
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", section))


def test_the_benches_map_names_every_bench_script():
    scripts = {n[:-3] for n in os.listdir(os.path.join(REPO, "bench")) if n.endswith(".py")}
    assert {"forward", "rl_step", "nothing_moved", "common"} <= scripts
    with open(ARCHITECTURE, encoding="utf-8") as f:
        named = bench_map_names(f.read())
    assert sorted(scripts - named) == []
    # The negative control: a script left out of the map is seen.
    text = "**The benches** (`bench/`): `forward`, `rl_step`.\n\n**Traced values** `compare`"
    assert bench_map_names(text) == {"forward", "rl_step"}
    assert {"nothing_moved", "compare"} <= scripts - bench_map_names(text)
