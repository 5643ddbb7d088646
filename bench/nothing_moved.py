"""The redesign's check that nothing moved: the embedded default's targeted 4-step run at two
commits, on this machine, compared value by value.

  python bench/nothing_moved.py --base=REV [--head=REV|WORKTREE] [--out=DIR]

Each side runs `python -m aqn_jax.launch --config=configs/targeted.py
--config.trainer.total_steps=4 --config.trainer.val_every=2 --config.trainer.val_size=64` from
its own tree (a `git worktree` of the revision, or the working tree itself when `--head` is
omitted), into `DIR/{base,head}`, with that tree's `aqn_jax` first on `PYTHONPATH`. Then every
metric value of `metrics.jsonl` is compared exactly, except the ones that time the machine
(keys naming seconds, time, throughput or memory), and the `manifest.json` of the two
checkpoints byte for byte. Prints `NOTHING_MOVED equal=<n> of=<m> new=[...] gone=[...]
manifest=<identical|differs>` and exits 1 when any shared value or the manifest differs.

XLA:CPU's f32 results differ between CPU models, so both sides run here, one after the other;
a comparison across machines means nothing. This is a check, not a speed bench: it prints no
`BENCH` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
    "--config=configs/targeted.py",
    "--config.trainer.total_steps=4",
    "--config.trainer.val_every=2",
    "--config.trainer.val_size=64",
]
# Metric keys that measure the machine, not the computation.
TIMING = ("time", "seconds", "_s/", "wall", "per_s", "throughput", "tokens_per", "rss", "memory")


def timing(key: str) -> bool:
    k = key.lower()
    return k.endswith("_s") or any(t in k for t in TIMING)


def flatten(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def values(workdir: str) -> dict:
    """{(line, key): value} for every non-timing value of the run's metrics.jsonl."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for i, line in enumerate(f):
            flat: dict = {}
            flatten("", json.loads(line), flat)
            for k, v in flat.items():
                if not timing(k):
                    out[(i, k)] = v
    return out


def manifests(workdir: str) -> dict:
    found = {}
    for root, _, files in os.walk(workdir):
        for name in files:
            if name == "manifest.json":
                with open(os.path.join(root, name), "rb") as f:
                    found[os.path.relpath(os.path.join(root, name), workdir)] = f.read()
    return found


def compare(base: str, head: str) -> tuple[int, int, list, list, bool]:
    a, b = values(base), values(head)
    shared = sorted(set(a) & set(b))
    equal = sum(1 for k in shared if a[k] == b[k])
    new = sorted({k for _, k in set(b) - set(a)})
    gone = sorted({k for _, k in set(a) - set(b)})
    return equal, len(shared), new, gone, manifests(base) == manifests(head)


def run(tree: str, workdir: str) -> None:
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "aqn_jax.launch", *ARGS, f"--workdir={workdir}"]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)


def worktree(rev: str, parent: str) -> str:
    path = os.path.join(parent, "tree_" + rev.replace("/", "_"))
    subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "--detach", path, rev],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the revision before")
    p.add_argument("--head", default=None, help="a revision or a tree (default: this tree)")
    p.add_argument("--out", default=None, help="where the two runs go (default: a temp dir)")
    p.add_argument("--compare-only", action="store_true", help="compare DIR/{base,head} as found")
    args = p.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="nothing_moved_")
    base_dir, head_dir = os.path.join(out, "base"), os.path.join(out, "head")
    if not args.compare_only:
        for d in (base_dir, head_dir):
            if os.path.exists(d):
                sys.exit(f"--out: {d} exists; give an empty or new folder")
        os.makedirs(out, exist_ok=True)
        made = []
        try:
            base_tree = worktree(args.base, out)
            made.append(base_tree)
            if args.head is None:
                head_tree = REPO
            elif os.path.isdir(args.head):
                head_tree = os.path.abspath(args.head)
            else:
                head_tree = worktree(args.head, out)
                made.append(head_tree)
            run(base_tree, base_dir)
            run(head_tree, head_dir)
        finally:
            for t in made:
                subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", t], check=False)
    equal, shared, new, gone, same = compare(base_dir, head_dir)
    print(
        f"NOTHING_MOVED equal={equal} of={shared} new={new} gone={gone} "
        f"manifest={'identical' if same else 'differs'} runs={out}"
    )
    sys.exit(0 if equal == shared and same else 1)


if __name__ == "__main__":
    main()
