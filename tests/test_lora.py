"""QeRL mode: LoRA adapters in the factored form, a packed NVFP4/MXFP4 base, the export.

Every check here is against numbers: a fresh adapter (B = 0) is bitwise the base; the packed
base dequantises to `formats`' fake quantisation bit for bit; the export's logits in
transformers equal ours with the adapters on. A LoRA run over an NVFP4 base (the base stays
bitwise, only the adapters and their moments train and are saved, a killed run resumes exactly)
is tests/test_resume.py's: its runs are QeRL mode's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax import lora as lora_lib
from aqn_jax import quant_base
from aqn_jax.faults import formats
from aqn_jax.faults.intercept import FaultPlan, Injection
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import NoisyLinear, Scale
from aqn_jax.forward import Weights, forward
from aqn_jax.models.qwen2 import Qwen2Config
from aqn_jax.models.registry import causal_lm, family_of

from conftest import load_config, random_params
from tolerance import bound, forward_path

# The tiny preset's widths at 2 layers: every linear input (128, 384) is a multiple of both
# formats' blocks (16, 32).
CFG = Qwen2Config.tiny(num_hidden_layers=2)
SITE_OF = family_of(CFG).site_of


def _spec(rank=4, **kw):
    targets = family_of(CFG).linear_kinds
    return lora_lib.LoraSpec(rank, kw.pop("alpha", 8.0), targets, kw.pop("ln", False))


def _ids(b=2, t=12, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(3, CFG.vocab_size, (b, t)), jnp.int32)


def _adapters(spec, params, b_scale=0.0, seed=1):
    """Fresh adapters; with b_scale > 0, B drawn N(0, b_scale^2) (a trained-looking adapter)."""
    tr = lora_lib.init_trainable(spec, params, SITE_OF, jax.random.key(seed))
    if b_scale:
        leaves, tdef = jax.tree_util.tree_flatten_with_path(tr)
        rng = np.random.RandomState(seed)
        tr = jax.tree_util.tree_unflatten(
            tdef,
            [
                jnp.asarray(rng.randn(*x.shape) * b_scale, x.dtype)
                if jax.tree_util.keystr(p).endswith("['b']")
                else x
                for p, x in leaves
            ],
        )
    return tr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fresh_adapter_is_bitwise_the_base(dtype):
    cfg = dataclasses.replace(CFG, dtype=dtype)
    model, params, ids = causal_lm(cfg), random_params(cfg), _ids()
    spec = _spec()
    run = jax.jit(lambda p: forward(model, p, ids))
    base = np.asarray(run(params))
    fresh = np.asarray(run(lora_lib.weights(spec, params, _adapters(spec, params))))
    # y + scale * (x A) 0 == y exactly, but the two are two programs: in float32 XLA:CPU may
    # block the base matmuls differently once the adapter's product joins them (AMD EPYC with
    # AVX-512: 5.7e-6 on logits of ~10; bitwise on AVX2), so the bound is f32 rounding along
    # the forward (tests/tolerance.py); in bfloat16 the outputs are bitwise equal.
    tol = bound(forward_path(cfg, ids.shape[1]), np.abs(base).max()) if dtype == "float32" else 0
    np.testing.assert_allclose(fresh, base, rtol=0, atol=tol)
    # Negative control: B != 0 moves the logits, by far more than rounding.
    moved = np.asarray(run(lora_lib.weights(spec, params, _adapters(spec, params, 0.05))))
    assert np.max(np.abs(moved - base)) > max(1e-2, 10 * tol)


@pytest.mark.slow
def test_faults_see_base_plus_adapter():
    """A noisy-linear fault redoes the product: at scale 0 it equals the model's own Linear
    with the adapter (y, and dA, dB through its custom backward, against autodiff). One
    layer holds every linear kind (each with its adapter)."""
    cfg = dataclasses.replace(CFG, num_hidden_layers=1)
    model, params, ids = causal_lm(cfg), random_params(cfg), _ids()
    spec = _spec()
    tr = _adapters(spec, params, 0.05)
    # The fault's scale is a traced value: scale 0 and scale 0.05 are one compiled program.
    scaled = FaultPlan(
        [
            Injection(
                "nl",
                SiteSelector(("linear",), "all"),
                NoisyLinear(Scale(1.0, value="scale")),
                ("train",),
            )
        ]
    )

    def loss(tr, plan, scale=None):
        w = lora_lib.weights(spec, params, tr)
        values = None if plan is None else {"scale": scale}
        key = jax.random.key(0)
        logits = forward(model, w, ids, plan=plan, phase="train", key=key, values=values)
        return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

    (_, plain), g_plain = jax.jit(jax.value_and_grad(lambda t: loss(t, None), has_aux=True))(tr)
    faulty = jax.jit(jax.value_and_grad(lambda t, s: loss(t, scaled, s), has_aux=True))
    (_, noisy), g_noisy = faulty(tr, jnp.float32(0.0))
    # Two programs of the same f32 computation, fused differently (XLA may merge the x W and
    # x A products of the plain Linear, which the custom_vjp keeps apart): REFERENCE's f32
    # parity bound for logits of O(10), 1e-4; gradients to 1e-4 of their largest entry.
    np.testing.assert_allclose(np.asarray(noisy), np.asarray(plain), rtol=0, atol=1e-4)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_noisy), strict=True):
        bound = 1e-4 * float(np.max(np.abs(a))) + 1e-12
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=bound)
    # The adapter's gradient is live (B's gradient at a non-zero adapter is not zero).
    assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g_plain)) > 1e-4
    # With error on, the output moves: the fault acts on base plus adapter.
    (_, noisy5), _ = faulty(tr, jnp.float32(0.05))
    assert np.max(np.abs(np.asarray(noisy5) - np.asarray(plain))) > 1e-3


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_base_is_the_fake_quantisation(fmt):
    params = random_params(CFG)
    packed = quant_base.pack(params, fmt, SITE_OF)
    deq = jax.jit(quant_base.dequantize)(packed)
    kernels = quant_base.linear_kernel_paths(params, SITE_OF)
    assert len(kernels) == 7 * CFG.num_hidden_layers
    paths = {tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    for path in paths:
        x, y = params, deq
        for k in path:
            x, y = x[k], y[k]
        x, y = np.asarray(x), np.asarray(y)
        if path in kernels:
            want = np.asarray(
                formats.quantize_nvfp4(x, axis=0)
                if fmt == "nvfp4"
                else formats.quantize_mx(x, "mxfp4", axis=0)
            )
            np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
            assert not np.array_equal(y, x)  # the kernel really is quantised
        else:  # embeddings, norms, biases, lm_head: untouched
            np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))
    # Bytes: 4 bits a weight + one 8-bit scale per block, + 8 bytes of scalars per kernel.
    n = sum(int(np.prod(quant_base.leaf_at(params, p).shape)) for p in kernels)
    block = 16 if fmt == "nvfp4" else 32
    packed_bytes = sum(quant_base.leaf_at(packed, p).nbytes for p in kernels)
    assert packed_bytes == n // 2 + n // block + 8 * len(kernels)
    print(f"{fmt}: packed {packed_bytes} B vs bf16 {2 * n} B = {packed_bytes / (2 * n):.4f}")


def test_export_matches_transformers(tmp_path):
    import torch
    import transformers

    from aqn_jax.export import export_policy

    params = random_params(CFG)
    spec = _spec(rank=4, alpha=16.0)
    packed = quant_base.pack(params, "nvfp4", SITE_OF)
    tr = _adapters(spec, params, 0.05)
    ids = _ids(2, 16)
    ours = np.asarray(
        jax.jit(lambda w: forward(causal_lm(CFG), w, ids))(
            Weights(packed, tr["lora"], None, spec.scale)
        )
    )
    out = export_policy(str(tmp_path / "export"), CFG, lora_lib.merged(spec, packed, tr), "")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()
    # f32 logits of O(10) through 2 layers, merged (W + sAB) vs factored (xW + s(xA)B):
    # REFERENCE's parity bound 1e-4.
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)
    assert (tmp_path / "export" / "char_tokenizer.json").is_file()
    # Negative control: the export of the base alone (no merge) is far from ours.
    bare = export_policy(str(tmp_path / "bare"), CFG, quant_base.dequantize(packed), "")
    hf = transformers.AutoModelForCausalLM.from_pretrained(bare, torch_dtype=torch.float32)
    with torch.no_grad():
        unmerged = hf(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(unmerged - ours)) > 1e-2


def test_plain_policy_merges_over_the_warm_start_it_is_given():
    """The train job's export goes through `export.plain_policy` with the warm start it holds
    (`warm`; the other jobs load theirs, `jobs.run_policy`): the adapters merged into that base
    packed in the run's format, as `lora.merged`; full fine-tuning's params as they are.
    Negative control: another base gives other weights."""
    from aqn_jax.export import plain_policy

    config = load_config("targeted", "smoke")
    config.lora.rank, config.lora.alpha, config.model.weight_format = 4, 16.0, "nvfp4"
    params = random_params(CFG)
    spec = _spec(rank=4, alpha=16.0)
    assert lora_lib.lora_spec(config.lora) == spec
    tr = _adapters(spec, params, 0.05)
    cfg, plain = plain_policy(spec, "nvfp4", tr, (CFG, params))
    expect = lora_lib.merged(spec, quant_base.pack(params, "nvfp4", SITE_OF), tr)
    assert cfg is CFG
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(plain), leaves(expect), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert plain_policy(spec, "nvfp4", params, (CFG, params))[1] is params
    other = random_params(CFG, seed=7)
    _, moved = plain_policy(spec, "nvfp4", tr, (CFG, other))
    diffs = [
        np.max(np.abs(np.asarray(a) - np.asarray(b)))
        for a, b in zip(leaves(moved), leaves(plain), strict=True)
    ]
    assert max(diffs) > 1e-3


def test_qerl_config_errors():
    from aqn_jax.checks import check_qerl

    def qerl(config):  # as check_train parses the sections it takes
        lora, fmt = lora_lib.lora_spec(config.lora), config.model.weight_format
        check_qerl(lora, fmt, config.checkpoint.export, CFG, training=True)

    def err(**over):
        config = load_config("targeted", "smoke")
        for k, v in over.items():
            node, *path = k.split(".")
            target = config[node]
            for p in path[:-1]:
                target = target[p]
            target[path[-1]] = v
        with pytest.raises(ValueError) as e:
            qerl(config)
        return str(e.value)

    assert "config.lora.rank=-1" in err(**{"lora.rank": -1})
    assert "config.lora.alpha=0" in err(**{"lora.rank": 4, "lora.alpha": 0})
    assert "config.lora.target_modules" in err(
        **{"lora.rank": 4, "lora.target_modules": "q_proj,qkv"}
    )
    assert "exceeds min(in, out) = 64" in err(**{"lora.rank": 65, "lora.target_modules": "k_proj"})
    assert "config.model.weight_format='fp4'" in err(**{"model.weight_format": "fp4"})
    assert "train_norms=True needs config.lora.rank > 0" in err(**{"lora.train_norms": True})
    assert "freezes the base" in err(**{"model.weight_format": "nvfp4"})
    assert "config.checkpoint.export='safetensors'" in err(**{"checkpoint.export": "safetensors"})
    # Valid: nothing raised.
    config = load_config("targeted", "smoke")
    config.lora.rank, config.model.weight_format = 64, "mxfp4"
    qerl(config)


def test_export_job_refuses_a_run_without_checkpoint(tmp_path):
    from aqn_jax.jobs.export import check_config

    config = load_config("export")
    with pytest.raises(ValueError, match=r"config.export.run=''; name a train run's workdir"):
        check_config(config)
    config.export.run = str(tmp_path)
    with pytest.raises(ValueError, match="no config.json there"):
        check_config(config)
    (tmp_path / "config.json").write_text(load_config("targeted", "smoke").to_json())
    with pytest.raises(ValueError, match="has no checkpoint"):
        check_config(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # nothing written
