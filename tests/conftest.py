"""Shared fixtures: tiny random HF Qwen2 checkpoints made locally (no hub access)."""

import getpass
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One persistent XLA compilation cache for the whole session: both xdist workers and every
# subprocess a test starts (they inherit the environment). The arm smokes, resume, multi-host
# and real-scale runs compile the same programs; entries are keyed by the program, the JAX
# version and the flags, so a stale entry is never used for a different program.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"aqn_jax_test_xla_cache_{getpass.getuser()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np
import pytest
import transformers

transformers.utils.logging.disable_progress_bar()


def pytest_collection_modifyitems(config, items):
    """The `slow` tests (each ~40-200 s of one worker with a cold XLA cache) run first, in file
    order, and the short ones after them. xdist hands out tests one at a time in collection
    order, so the long ones start early and the short ones even out the two workers' ends
    (longest first); in file order the 90 s learning test in test_train.py came near the end,
    where it could leave one worker running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    _xdist_groups(config, items)


def _xdist_groups(config, items):
    """`--dist loadgroup` sends the tests of one `xdist_group` to one worker by the suffix
    `@<group>` that pytest-xdist (3.8) appends to their node ids, by setting `item._nodeid`;
    pytest 9 reads a node id from `item._id` instead, so the suffix never arrived and a group's
    tests ran on both workers (the SmolLM2 import, ~60-90 s, made once per worker). The suffix
    set here the way pytest 9 reads it; a no-op where xdist's own already took."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


def randomize_hf_weights(model, seed: int) -> None:
    """Replace HF's init (zero biases, unit norms, std 0.02) by weights that make logits O(10).

    With HF's own init the logits are ~1e-2 and a parity bound of 1e-4 would be loose; here
    every tensor is random, so a wrong bias, norm, RoPE or head mapping shows up.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))


def make_hf_model(path, seed: int = 0, family: str = "qwen2", **overrides):
    """A random transformers Qwen2ForCausalLM (or LlamaForCausalLM / MistralForCausalLM: the
    same decoder without q/k/v biases) saved with save_pretrained into `path`."""
    import torch
    import transformers

    Config, Model = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]

    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e4,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        attn_implementation="eager",
    )
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Model(Config(**kw)).eval()
    randomize_hf_weights(model, seed)
    model.save_pretrained(str(path))
    return model


def make_qwen_snapshot(path, texts, vocab_size: int, **model_overrides) -> str:
    """A Qwen-like local snapshot in `path`: a byte-level BPE tokenizer trained on `texts` to
    `vocab_size` tokens plus Qwen's control tokens and Qwen2.5's chat template, and a random
    transformers Qwen2 over that vocabulary (`make_hf_model`, with `model_overrides`)."""
    import transformers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from test_tokenizers import QWEN25_CHAT_TEMPLATE, SPECIALS

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rust.train_from_iterator(texts, trainer)
    rust.add_special_tokens(SPECIALS)
    make_hf_model(path, vocab_size=rust.get_vocab_size(), **model_overrides)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=rust,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN25_CHAT_TEMPLATE,
    ).save_pretrained(str(path))
    return str(path)


@pytest.fixture
def hf_factory(tmp_path):
    counter = iter(range(1000))

    def factory(seed=0, **overrides):
        path = tmp_path / f"hf_{next(counter)}"
        model = make_hf_model(path, seed=seed, **overrides)
        return str(path), model

    return factory


def left_padded_batch(rng: np.random.RandomState, vocab: int, lengths, total: int):
    """ids/mask/positions [B, total] with sequence b occupying the last lengths[b] slots."""
    ids = rng.randint(0, vocab, size=(len(lengths), total))
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, total - n :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def random_params(config, seed: int = 0):
    """Our own params for `config`, random at a scale that makes logits O(10)."""
    import jax

    from aqn_jax.models.hf import abstract_params

    shapes = abstract_params(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    rng = np.random.RandomState(seed)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            value = 1.0 + 0.2 * rng.randn(*leaf.shape)
        elif "bias" in name:
            value = 0.3 * rng.randn(*leaf.shape)
        elif "embedding" in name:
            value = 0.25 * rng.randn(*leaf.shape)
        else:
            value = rng.randn(*leaf.shape) / np.sqrt(leaf.shape[0])
        out.append(value.astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _session_dir(tmp_path_factory):
    """A directory of this test session shared by both xdist workers (`.../pytest-N`; each
    worker's own base temp is `pytest-N/popen-gwK`)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def sft_cache(tmp_path_factory):
    """One `config.sft.cache_dir` for the whole test session, both xdist workers included: the
    smoke configs share one SFT warm start (one cache key), so it trains once, not once per
    test module. Concurrent writers are safe (warm_start publishes by rename; the first wins).
    Tests that check what the cache holds (a miss, an entry count, nothing written) keep their
    own directory."""
    path = _session_dir(tmp_path_factory) / "sft_cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def sft_tiny():
    """The embedded tiny model after SFT, for the tests that need a trained model: the shipped
    warm start (aqn_jax/assets: 600 steps over the embedded task's train split, made by
    configs/warm_start.py; greedy test accuracy 0.832), read from disk, so no test session
    trains one. (Qwen2Config, params, CharTokenizer, the embedded task: 1 digit, 1 step, split
    by question.) It replaced a 30-step SFT run inside the session (~50-60 s of a worker)."""
    from aqn_jax.data.config import task_of
    from aqn_jax.data.tokenizers import CharTokenizer
    from aqn_jax.models.hf import load_hf_checkpoint
    from aqn_jax.spec import warm_start_spec
    from aqn_jax.warm_start import SHIPPED_DIR

    config = load_config("targeted")
    shipped = os.path.join(SHIPPED_DIR, f"sft-{warm_start_spec(config).key}")
    cfg, params = load_hf_checkpoint(shipped, "float32")
    return cfg, params, CharTokenizer(), task_of(config.data)


# The smoke runs' model (issue 32): the tiny preset's widths at 3 decoder layers, the deadzone
# at the middle one between two healthy ones. A run's compile time tracks depth: the clean arm's
# smoke with a cold XLA cache takes 58 s at 8 layers, 44 s at 4, 34 s at 3. The smoke runs that
# share `sft_cache` all use it, so their warm start (one cache key) trains once per session.
SHALLOW = {"model.num_layers": 3, "faults.deadzone.layers": "1"}
SHALLOW_FLAGS = tuple(f"--config.{key}={value}" for key, value in SHALLOW.items())
SHALLOW_LAYERS, SHALLOW_FAULT = 3, 1


@pytest.fixture(scope="session")
def clean_smoke(sft_cache, tmp_path_factory):
    """The clean arm's smoke on the shallow model (`configs/clean.py:smoke`, SHALLOW), run once
    for the tests that read it: test_train.py's every-arm check and test_sdc.py's guard, which
    compares its recomputed run with this one. Both are in `xdist_group("clean_smoke")`, so one
    worker runs them and this run once. (workdir, what RL step 1 lowered or compiled:
    `lowered_during_step_1`.)"""
    from aqn_jax.launch import run

    workdir = tmp_path_factory.mktemp("clean_smoke")
    config = load_config("clean", "smoke")
    config.sft.cache_dir = sft_cache
    # Every row's prompt computed, as in the guarded runs compared with this one (SDC keeps the
    # per-row passes: `FaultPlan.split_refusals`); the clean device would share it.
    config.rollout.share_prompt = config.actor.share_prompt = False
    with pytest.MonkeyPatch.context() as patch:
        made = lowered_during_step_1(patch)
        run(shallow(config), str(workdir))
    return workdir, list(made)


def set_fields(config, **over):
    """`config` with `over`'s fields (dotted keys: `**{"trainer.total_steps": 2}`) set in place;
    returned."""
    for key, value in over.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config


def shallow(config, **over):
    """`config` with SHALLOW's fields and then `over`'s (dotted keys) set in place; returned."""
    return set_fields(config, **{**SHALLOW, **over})


def config_module(name: str):
    """`configs/<name>.py` as a module, loaded by path as `--config=configs/<name>.py` loads it."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config(name: str, arg: str | None = None):
    """`configs/<name>.py`'s get_config([arg]), as `--config=configs/<name>.py[:arg]` loads it."""
    module = config_module(name)
    return module.get_config() if arg is None else module.get_config(arg)


def tree_state(root) -> dict:
    """Everything under `root` as {relative path: (mode, bytes)} (a directory's bytes None), to
    assert a refused command left a directory byte-identical (`tree_state(a) == before`)."""
    import pathlib

    root, out = pathlib.Path(root), {}
    for path in sorted(root.rglob("*")):
        data = None if path.is_dir() else path.read_bytes()
        out[str(path.relative_to(root))] = (path.stat().st_mode, data)
    return out


def launch_cli(*args, workdir, cwd=None, env=None):
    """`python -m aqn_jax.launch ARGS --workdir=WORKDIR` in a subprocess (CPU, offline; `env`
    adds variables)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "aqn_jax.launch", *args, f"--workdir={workdir}"],
        cwd=cwd or repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def lowered_during_step_1(monkeypatch) -> list:
    """Patches `Trainer.step` to record what JAX lowers or compiles during RL step 1 (a list
    filled as the run goes): nothing, when the train job compiled the step programs ahead
    (training.Ahead). Lowering is recorded, not only XLA compiles: a program the persistent
    cache holds is lowered, then loaded, never compiled."""
    from jax import monitoring

    from aqn_jax.rl.trainer import Trainer

    made, step = [], Trainer.step

    def durations(event, duration, **kw):
        if event.endswith(("jaxpr_to_mlir_module_duration", "backend_compile_duration")):
            made.append(event)

    def requests(event, **kw):
        if event.endswith("compile_requests_use_cache"):
            made.append(event)

    def recorded(self, state, t):
        if t != 1:
            return step(self, state, t)
        monitoring.register_event_duration_secs_listener(durations)
        monitoring.register_event_listener(requests)
        try:
            return step(self, state, t)
        finally:
            monitoring.unregister_event_duration_listener(durations)
            monitoring.unregister_event_listener(requests)

    monkeypatch.setattr(Trainer, "step", recorded)
    return made


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The SmolLM2-135M-Instruct GGUF import (aqn_jax/models/gguf.py), once a session (the
    tests that use it share one xdist_group, "smollm2"), with the GGUF-loaded PyTorch model it
    made kept for the checks (a spy on from_pretrained: the model is loaded once)."""
    from aqn_jax.models import gguf as gguf_import

    loaded = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loaded.append(original(*args, **kwargs))
        return loaded[-1]

    out = tmp_path_factory.mktemp("gguf_smollm2") / "SmolLM2-135M-Instruct"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
        record = gguf_import.gguf_to_hf(gguf_import.smollm2_path(), str(out))
    assert len(loaded) == 1
    return out, record, loaded[0]
