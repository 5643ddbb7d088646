"""A trained policy out of the product: an HF snapshot that transformers, vLLM and our own
evaluate job load (verl's `model_merger`, tunix's `save_lora_merged_model_as_safetensors`).

`export_policy(out, model_cfg, params, tokenizer_source)` writes `config.json`, the safetensors
and the tokenizer's files into `out` through a temporary directory beside it renamed into place
(a half-written export is never found). It never deletes what it did not write: an existing
`out` is replaced only when it is an empty directory or an earlier export (its `MARKER` file,
which lists the files it wrote) holding nothing else; anything else is refused, naming what is
not the export's (`check_target`, before any work); files and directories get the modes the
umask gives. In QeRL mode `params` is `lora.merged(...)`: the adapters
merged into the dequantised base, W' = W + (alpha / rank) A B.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import jax

from aqn_jax import quant_base
from aqn_jax.data.tokenizers import CHAR_TOKENIZER_FILE, HF_TOKENIZER_FILE, load_tokenizer
from aqn_jax.lora import LoraSpec, fingerprint, merged
from aqn_jax.models.hf import save_hf_checkpoint
from aqn_jax.models.registry import family_of

EXPORT_DIR = "export"
# The file every export holds, listing the files it wrote (one a line, after its first line): an
# existing directory is replaced only when it has one and nothing the list does not name.
MARKER = ".aqn_jax_export"
MARKER_TEXT = "an HF snapshot written by aqn_jax's export; replaced by the next one; its files:\n"
# An export made before the marker listed its files wrote these (and the safetensors).
_UNLISTED = re.compile(r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# The files of an HF snapshot that describe its tokenizer and generation (copied when present).
TOKENIZER_FILES = (
    HF_TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    CHAR_TOKENIZER_FILE,
)


def check_target(
    out: str, field: str, run_dir: str | None = None, workdir: str | None = None
) -> str:
    """`out` (absolute) if an export may be written there, else a one-line ValueError naming
    `field`: a file, a directory that is not an earlier export (no `MARKER`; an empty one is
    fine), an earlier export holding files it did not write (named), the train run `run_dir`
    itself or a directory holding it, a path inside the run other than its `EXPORT_DIR`, the
    command's own `workdir` or a directory holding it, or a place this user cannot create or
    write. Writes nothing."""
    out = os.path.abspath(os.path.expanduser(out))
    real = os.path.realpath(out)
    if run_dir is not None:
        run = os.path.realpath(run_dir)
        inside = real == run or real.startswith(run + os.sep) or run.startswith(real + os.sep)
        if inside and real != os.path.join(run, EXPORT_DIR):
            raise ValueError(
                f"{field}={out}: the run {run_dir} itself, a directory inside it or one that"
                f" holds it; allowed: {os.path.join(run_dir, EXPORT_DIR)} (the default) or a path"
                " outside the run"
            )
    if workdir is not None:
        work = os.path.realpath(workdir)
        if work == real or work.startswith(real + os.sep):
            raise ValueError(
                f"{field}={out}: {'is' if work == real else 'holds'} this command's own"
                f" --workdir={workdir} (its lock and log go there); choose another --workdir or"
                f" {field}"
            )
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"{field}={out}: is a file; choose a new directory or an earlier export")
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.isfile(os.path.join(out, MARKER)):
            raise ValueError(
                f"{field}={out}: an existing directory that is not an export (no {MARKER} in"
                f" it; it holds {_names(sorted(os.listdir(out)), out)}); nothing is deleted:"
                " choose a new directory or an earlier export"
            )
        foreign = sorted(set(os.listdir(out)) - _written(out))
        if foreign:
            raise ValueError(
                f"{field}={out}: an earlier export, but it also holds {_names(foreign, out)},"
                " which the export did not write; nothing is deleted: move them out, or choose"
                " a new directory"
            )
    parent = os.path.dirname(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a probe, removed at once: os.access says yes to root, also under /proc
        os.rmdir(tempfile.mkdtemp(prefix=".aqn_jax-probe-", dir=parent))
    except OSError as e:
        raise ValueError(
            f"{field}={out}: {parent} is not a writable directory ({e.strerror}); choose another"
        ) from None
    return out


def _written(out: str) -> set[str]:
    """The names of the files the earlier export in `out` wrote, its `MARKER` included."""
    with open(os.path.join(out, MARKER)) as f:
        listed = {line.strip() for line in f.read().splitlines()[1:] if line.strip()}
    if not listed:  # made before the marker listed its files
        listed = {n for n in os.listdir(out) if n in TOKENIZER_FILES or _UNLISTED.fullmatch(n)}
    return listed | {MARKER}


def _names(names: list[str], out: str, most: int = 5) -> str:
    """`names` (entries of `out`) for a message: directories with a '/', at most `most`."""
    shown = [n + "/" if os.path.isdir(os.path.join(out, n)) else n for n in names[:most]]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(shown) + more


def export_policy(
    out: str, model_cfg, params, tokenizer_source: str, field: str = "config.export.out"
) -> str:
    """Write the snapshot into `out` (an earlier export there replaced; `check_target` refuses
    anything else, naming `field`); returns `out`. `tokenizer_source`: the directory the run's
    tokenizer came from ('' = the embedded one)."""
    out = check_target(out, field)
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    except OSError as e:
        raise ValueError(f"{field}={out}: cannot be written ({e.strerror}); choose another") from e
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700: the mode a mkdir gets
        save_hf_checkpoint(tmp, model_cfg, params)
        copied = 0
        if tokenizer_source:
            for name in TOKENIZER_FILES:
                src = os.path.join(tokenizer_source, name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(tmp, name))  # the umask's mode
                    copied += 1
        if not copied:  # the embedded character tokenizer
            load_tokenizer(tokenizer_source or None).save(tmp)
        names = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write(MARKER_TEXT + "".join(f"{name}\n" for name in names))
        for name in os.listdir(tmp):  # some writers make their files 0600 (a temporary file)
            os.chmod(os.path.join(tmp, name), 0o666 & ~_umask())
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(tmp: str, out: str) -> None:
    """`tmp` renamed to `out`; an earlier export there is renamed aside first and removed only
    once the new one is in place (restored if the rename fails)."""
    if not os.path.isdir(out) or not os.listdir(out):
        os.replace(tmp, out)  # nothing there, or an empty directory
        return
    aside = tempfile.mkdtemp(prefix=".export-old-", dir=os.path.dirname(out))
    old = os.path.join(aside, "export")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        os.rmdir(aside)
        raise
    shutil.rmtree(aside)


def plain_policy(lora: LoraSpec, fmt: str, trained, warm: tuple, base_print: str | None = None):
    """(model config, a plain param tree) of a run's trained params: as they are for full
    fine-tuning; for a LoRA run (`{"lora": ...}`, `lora`: its config.lora) the adapters merged
    into its base, the run's warm start `warm` (model config, float params: `warm_start`'s) in
    `fmt` (its config.model.weight_format). `base_print`: the checkpoint's fingerprint of its
    base; a different base is refused (one line)."""
    model_cfg, base = warm
    if "lora" not in trained:
        return model_cfg, trained
    base = jax.device_get(base)
    if base_print is not None and base_print != f"{fmt}:{fingerprint(base)}":
        raise ValueError(
            f"the checkpoint's adapters were trained over base {base_print}, but config.model /"
            f" config.sft / weight_format give {fmt}:{fingerprint(base)[:12]}...; pass the run's"
            " own config"
        )
    packed = quant_base.pack(base, fmt, family_of(model_cfg).site_of)
    return model_cfg, merged(lora, packed, trained)
