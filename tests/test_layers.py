"""aqn_jax/layers.py, the layers picture's tool, against docs/ARCHITECTURE.md's table and
tests/test_layout.py's job rules: every module sits in a room, the jobs are the ones test_layout
knows, every arrow goes down, and a planted upward import, a same-row import and a module in no
room are each found."""

import os

from test_layout import ARCHITECTURE, JOBS, REPO, job_imports

from aqn_jax import layers as tool

with open(ARCHITECTURE, encoding="utf-8") as _f:
    LAYERS = tool.read_layers(_f.read())
SOURCES = tool.read_sources(LAYERS)


def test_every_module_has_a_room_and_every_arrow_goes_down():
    g = tool.graph(SOURCES, LAYERS)
    assert g.unassigned() == [] and g.upward() == []
    names = [layer.name for layer in g.layers]
    assert names[:3] == ["benches", "entry", "jobs"] and names[-2:] == ["utilities", "registry"]
    # Every room the table names holds a module, and every module the walk found has one.
    rooms = {r for layer in LAYERS for r in layer.rooms}
    assert set(g.room.values()) == rooms and len(g.room) > 120
    # Arrows the table's order rests on: the launcher runs the jobs, the reward methods are a
    # Registry (so registry.py sits a row below rewards.py), the model knows no fault.
    assert ("aqn_jax/launch.py", "aqn_jax/jobs/") in g.arrows
    assert ("aqn_jax/rewards.py", "aqn_jax/registry.py") in g.arrows
    assert ("aqn_jax/models/", "aqn_jax/faults/") not in g.arrows
    assert g.row("aqn_jax/registry.py") == len(LAYERS) - 1
    # Between layers: every pair goes from a row to a lower one.
    assert all(b > a for a, b in g.between_layers()) and len(g.between_layers()) > 50


def test_the_tool_places_the_jobs_as_test_layout_does():
    """test_layout's jobs are the tool's `aqn_jax/jobs/` room on the row `jobs`; the only rooms
    importing it are above it (the launcher, the benches), and no module of aqn_jax/ or
    configs/ but the launcher does, which is test_layout's rule seen from the tool."""
    g = tool.graph(SOURCES, LAYERS)
    jobs = {p for p, r in g.room.items() if r == "aqn_jax/jobs/"}
    assert {f"aqn_jax/jobs/{name}.py" for name in JOBS} <= jobs
    assert LAYERS[g.row("aqn_jax/jobs/")].name == "jobs"
    importers = {a for a, b in g.arrows if b == "aqn_jax/jobs/"}
    assert importers == {"aqn_jax/launch.py", "bench/"}
    assert all(g.row(a) < g.row("aqn_jax/jobs/") for a in importers)
    library = {p: s for p, s in SOURCES.items() if p.startswith(("aqn_jax/", "configs/"))}
    assert [p for p, s in library.items() if job_imports(s)] == []
    assert {a for a, b in g.arrows if b == "aqn_jax/jobs/" and not a.startswith("bench/")} == {
        g.room["aqn_jax/launch.py"]
    }


def test_a_planted_upward_import_is_found():
    """The negative control: a model module importing a job and the one-run layer (relative),
    a utility importing another on its own row, and a module in no room."""
    planted = "from aqn_jax.jobs import train\nfrom ..training import run\n"
    sources = {
        **SOURCES,
        "aqn_jax/models/planted.py": planted,
        "aqn_jax/lock.py": SOURCES["aqn_jax/lock.py"] + "\nimport aqn_jax.files\n",
        "aqn_jax/planted_room.py": "import os\n",
    }
    g = tool.graph(sources, LAYERS)
    assert g.upward() == [
        ("aqn_jax/lock.py", "aqn_jax/files.py"),
        ("aqn_jax/models/", "aqn_jax/jobs/"),
        ("aqn_jax/models/", "aqn_jax/training.py"),
    ]
    assert g.unassigned() == ["aqn_jax/planted_room.py"]
    assert job_imports(planted) == ["aqn_jax.jobs: ['train']"]  # test_layout sees it too


def test_the_command_counts_checks_and_draws(tmp_path, capsys):
    out = tmp_path / "layers.png"
    assert tool.main([f"--out={out}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"layers: {len(LAYERS)} layers, ")
    assert printed[0].endswith(", 0 upward")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 50_000
    # The committed picture is there and the architecture shows it.
    assert os.path.getsize(os.path.join(REPO, "docs", "layers.png")) > 50_000
    with open(ARCHITECTURE, encoding="utf-8") as f:
        assert "](layers.png)" in f.read().split("\n## The layers\n", 1)[1].split("\n## ", 1)[0]
    # A file without the table is refused in one line, exit 2.
    bad = tmp_path / "docs" / "ARCHITECTURE.md"
    bad.parent.mkdir()
    bad.write_text("# Architecture\n")
    assert tool.main([f"--architecture={bad}"]) == 2
    assert capsys.readouterr().err == f"layers: {bad}: no '## The layers' section\n"
