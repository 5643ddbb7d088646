"""bench/device/parts.py take (issue 69, item 3): a destination that holds another split of the
same file (the whole file's sha256 equal, the parts cut elsewhere) is refused in one line naming
the part's offset and size in both splits, and nothing is moved or copied; parts of one split,
or of a second split cut the same way, land in their place."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "device"))
import parts  # noqa: E402

from conftest import tree_state  # noqa: E402

MIB = 1 << 20


def _split(tmp_path, name: str, size: int):
    """The 30 bytes of f.bin in parts of `size` bytes, under tmp_path/name."""
    f = tmp_path / "f.bin"
    if not f.exists():
        f.write_bytes(bytes(range(30)))
    parts.split([str(f)], str(tmp_path / name), size / MIB)
    return tmp_path / name


def test_take_refuses_a_part_of_another_split_of_the_same_file(tmp_path, capsys):
    tens, fifteens = _split(tmp_path, "tens", 10), _split(tmp_path, "fifteens", 15)
    dest = tmp_path / "dest"
    assert parts.main(["take", f"--dir={tens}", "--part=1", f"--to={dest}"]) == 0
    before = tree_state(dest), tree_state(fifteens)
    capsys.readouterr()
    assert parts.main(["take", f"--dir={fifteens}", "--part=2", f"--to={dest}"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(
        f"error: --to='{dest}' holds another split of the same file: its part 2 is 10 bytes at"
        " offset 10 (sha256 "
    ), err
    assert "(3 parts of at most 10 bytes), this set's 15 bytes at offset 15 (sha256 " in err
    assert err.rstrip().endswith(
        "(2 parts of at most 15 bytes); take every part from one split, or empty it first"
    ), err
    assert (tree_state(dest), tree_state(fifteens)) == before  # nothing moved or copied
    # A part the destination's split does not have at all.
    ones = _split(tmp_path, "ones", 1)
    capsys.readouterr()
    assert parts.main(["take", f"--dir={ones}", "--part=4", f"--to={dest}"]) == 1
    assert "its part 4 is not in it (3 parts of at most 10 bytes)" in capsys.readouterr().err
    # Negative controls: the rest of the first split, and a second split cut the same way.
    again = _split(tmp_path, "again", 10)
    assert parts.main(["take", f"--dir={tens}", "--part=3", f"--to={dest}"]) == 0
    assert parts.main(["take", f"--dir={again}", "--part=2", f"--to={dest}"]) == 0
    assert parts.main(["check", f"--dir={dest}"]) == 0
    assert (dest / "002" / "part002.bin").read_bytes() == bytes(range(10, 20))
