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
OUTSIDE_NOTES = re.compile(r"\b(?:DESIGN|REFERENCE)\.md")


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


def test_the_code_cites_the_architecture_not_notes_outside_the_repo():
    """The design and reference facts the code relies on are in docs/ARCHITECTURE.md: no file
    under aqn_jax/ or configs/ cites DESIGN.md or REFERENCE.md, which a clone does not have."""
    bad = []
    for folder in ("aqn_jax", "configs"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if name.endswith((".py", ".md", ".txt")):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as f:
                        for i, line in enumerate(f, 1):
                            if OUTSIDE_NOTES.search(line):
                                bad.append(f"{os.path.relpath(path, REPO)}:{i}")
    assert bad == []
    assert OUTSIDE_NOTES.search("(see shared/REFERENCE.md)")
    assert not OUTSIDE_NOTES.search("(docs/ARCHITECTURE.md, decision 2)")
