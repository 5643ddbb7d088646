"""The layers of docs/ARCHITECTURE.md read from the code: every module's imports (with `ast`),
its room and its layer from the table under "## The layers", the arrows between them, and the
picture of them committed as docs/layers.png.

  python -m aqn_jax.layers --out=docs/layers.png   # the counts, the check and the picture
  python -m aqn_jax.layers                         # the counts and the check only

A layer is a row of the table, top to bottom; its rooms are the row's backticked paths: a folder
(`aqn_jax/faults/`: every module under it) or a file. The modules are the `.py` files under the
top folders the rooms name (aqn_jax/, configs/, bench/); a file with no statement (the package's
`__init__.py`) belongs to no room and imports nothing. An arrow is a room's module importing
another room's module (`import`, `from ... import`, relative, inside a function too), counted
once per pair of rooms. The table's rule: imports only go down, and rooms on one line do not
import each other; so an arrow is *upward* when its target's row is the same as its source's or
above it. Exit 0 with one line of counts; 1 with a line per module in no room and per upward
arrow (the picture is still drawn); 2, one line, when the table cannot be read.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE = os.path.join(REPO, "docs", "ARCHITECTURE.md")
NO_ROOM = ""  # the room of a module the table does not place


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    rooms: tuple[str, ...]  # repository paths: a folder ends in '/'


@dataclasses.dataclass(frozen=True)
class Graph:
    layers: tuple[Layer, ...]
    room: dict[str, str]  # module path -> its room ("" for none)
    arrows: collections.Counter  # (room, room) -> the number of module imports between them

    def row(self, room: str) -> int:
        """The row of `room` in the table, 0 at the top."""
        return next(i for i, layer in enumerate(self.layers) if room in layer.rooms)

    def upward(self) -> list[tuple[str, str]]:
        """The arrows the table forbids: to a room on the same row or above."""
        return sorted((a, b) for a, b in self.arrows if self.row(b) <= self.row(a))

    def between_layers(self) -> collections.Counter:
        """(source row, target row) -> the number of room arrows between the two rows."""
        out = collections.Counter()
        for a, b in self.arrows:
            out[self.row(a), self.row(b)] += 1
        return out

    def unassigned(self) -> list[str]:
        return sorted(m for m, r in self.room.items() if r == NO_ROOM)


def read_layers(text: str) -> tuple[Layer, ...]:
    """The rows of the table under '## The layers' in docs/ARCHITECTURE.md's `text`."""
    if "\n## The layers\n" not in text:
        raise ValueError("no '## The layers' section")
    section = text.split("\n## The layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] == "layer" or "---" in cells[0]:
            continue
        rooms = tuple(re.findall(r"`([^`]+)`", cells[1]))
        if not rooms:
            raise ValueError(f"layer {cells[0]!r} names no room")
        layers.append(Layer(cells[0], rooms))
    if not layers:
        raise ValueError("the '## The layers' section has no table")
    return tuple(layers)


def module_name(path: str) -> str:
    """`aqn_jax/faults/config.py` -> `aqn_jax.faults.config`; a package is its `__init__.py`."""
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def imported(path: str, source: str, known: Mapping[str, str]) -> set[str]:
    """The paths of the `known` modules (module name -> path) that the module at `path`
    imports: `import a.b`, `from a import b` (a module `a.b`, or a name of `a`), relative."""
    package = module_name(path)
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]  # a module's relative imports start at its package
    names = set()
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {known[n] for n in names if n in known} - {path}


def room_of(path: str, layers: Sequence[Layer]) -> str:
    """The room holding the module at `path` (the longest matching room), or ''."""
    rooms = [r for layer in layers for r in layer.rooms]
    held = [r for r in rooms if path == r or (r.endswith("/") and path.startswith(r))]
    return max(held, key=len) if held else NO_ROOM


def graph(sources: Mapping[str, str], layers: Sequence[Layer]) -> Graph:
    """The rooms and arrows of the modules in `sources` (repository path -> source text)."""
    code = {p: s for p, s in sources.items() if ast.parse(s, filename=p).body}
    known = {module_name(p): p for p in code}
    room = {p: room_of(p, layers) for p in code}
    arrows = collections.Counter()
    for path, source in code.items():
        for target in imported(path, source, known):
            a, b = room[path], room[target]
            if a and b and a != b:
                arrows[a, b] += 1
    return Graph(tuple(layers), room, arrows)


def read_sources(layers: Sequence[Layer], repo: str = REPO) -> dict[str, str]:
    """Every `.py` file under the top folders the rooms name, by its repository path."""
    tops = sorted({r.split("/")[0] for layer in layers for r in layer.rooms})
    out = {}
    for top in tops:
        for root, dirs, files in os.walk(os.path.join(repo, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as f:
                        out[os.path.relpath(path, repo).replace(os.sep, "/")] = f.read()
    return out


def summary(g: Graph) -> str:
    rooms = {r for r in g.room.values() if r}
    return (
        f"layers: {len(g.layers)} layers, {len(rooms)} rooms, {len(g.room)} modules, "
        f"{len(g.arrows)} arrows between rooms ({len(g.between_layers())} between layers), "
        f"{len(g.upward())} upward"
    )


def _label(room: str, g: Graph) -> str:
    """A room's name in the picture: its path without `aqn_jax/`, and its module count."""
    n = sum(1 for r in g.room.values() if r == room)
    name = room.removeprefix("aqn_jax/")
    return f"{name} ({n})" if room.endswith("/") else name


def plot(g: Graph, path: str) -> str:
    """The picture: a band per layer with its rooms, top to bottom, and on the right an arrow
    per pair of layers that import, from the source band to the target band, its width growing
    with the number of room arrows between them. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    n, pairs = len(g.layers), g.between_layers()
    fig, ax = plt.subplots(figsize=(14.2, 0.62 * n + 1.2))
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.7 / (0.62 * n + 1.2))
    ax.set_xlim(0, 14.2)
    ax.set_ylim(-0.6, n + 0.2)
    ax.axis("off")
    colors = plt.get_cmap("tab20")
    y = {i: n - 1 - i + 0.5 for i in range(n)}  # band centres, the top layer highest
    for i, layer in enumerate(g.layers):
        band = FancyBboxPatch((0.05, y[i] - 0.4), 10.6, 0.8, boxstyle="round,pad=0.01")
        band.set(facecolor=colors(i % 20), alpha=0.25, edgecolor="none")
        ax.add_patch(band)
        ax.text(0.15, y[i], layer.name, va="center", fontsize=10, fontweight="bold")
        _rooms(ax, [_label(r, g) for r in layer.rooms], y[i], colors(i % 20))
    _arrows(ax, g, pairs, y, colors, FancyArrowPatch)
    up = len(g.upward())
    ax.set_title(
        f"{summary(g).removeprefix('layers: ')}\n(python -m aqn_jax.layers --out=docs/layers.png;"
        f" rows and rooms from docs/ARCHITECTURE.md, arrows from the imports)\nan arrow's colour"
        f" is its importing layer's; its width grows with the number of rooms' imports"
        f"{'' if up == 0 else '; an upward arrow is red'}",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rooms(ax, labels: Sequence[str], y: float, color) -> None:
    """A row of room boxes from x = 1.55, each placed after the drawn width of the one before."""
    renderer, to_data = ax.figure.canvas.get_renderer(), ax.transData.inverted()
    x, size = 1.55, 9.0 if sum(len(s) for s in labels) < 80 else 8.0
    for label in labels:
        box = {"boxstyle": "round,pad=0.25", "fc": "white", "ec": color}
        text = ax.text(x, y, label, va="center", fontsize=size, bbox=box)
        (x0, _), (x1, _) = to_data.transform(text.get_window_extent(renderer).get_points())
        x += (x1 - x0) + 0.25


def _arrows(ax, g: Graph, pairs: Mapping, y: Mapping[int, float], colors, arrow) -> None:
    """The layer arrows, right of the bands: a pair's arrow leaves its source band at a height
    set by its target and enters the target band at a height set by its source, bending right
    in proportion to the rows it spans (so arrows of one span nest)."""
    n = len(g.layers)
    for (a, b), count in sorted(pairs.items(), key=lambda kv: (kv[0][1] - kv[0][0], kv[0])):
        start = (10.75, y[a] - 0.35 + 0.7 * (b + 0.5) / n)
        end = (10.75, y[b] - 0.35 + 0.7 * (a + 0.5) / n - (0.2 if a == b else 0.0))
        up = b <= a
        ax.add_patch(
            arrow(
                start,
                end,
                connectionstyle=f"arc3,rad={-0.55 if not up else 0.55}",
                arrowstyle="-|>",
                mutation_scale=7,
                lw=2.5 if up else 0.6 + 0.5 * min(count, 6),
                color="red" if up else colors(a % 20),
                alpha=1.0 if up else 0.8,
                zorder=4 if up else 2,
            )
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aqn_jax.layers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", help="the PNG to write (e.g. docs/layers.png)")
    parser.add_argument("--architecture", default=ARCHITECTURE, help="the file with the table")
    args = parser.parse_args(argv)
    try:
        with open(args.architecture, encoding="utf-8") as f:
            layers = read_layers(f.read())
    except (OSError, ValueError) as e:
        print(f"layers: {args.architecture}: {e}", file=sys.stderr)
        return 2
    repo = os.path.dirname(os.path.dirname(os.path.abspath(args.architecture)))
    g = graph(read_sources(layers, repo), layers)
    print(summary(g))
    bad = [f"layers: {m}: in no room of the table" for m in g.unassigned()]
    bad += [
        f"layers: {a} -> {b}: an upward arrow (row {g.row(a)} imports row {g.row(b)})"
        for a, b in g.upward()
    ]
    for line in bad:
        print(line, file=sys.stderr)
    if args.out:
        print(f"layers: wrote {plot(g, args.out)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
