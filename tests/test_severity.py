"""Job `severity` on the smoke setting: the curve's numbers are what they say (a quantile
deadzone flushes its stated fraction, the clean row has no fault), the prompt-dependence
control runs, and bad input fails before the warm start."""

import json

import pytest

from conftest import load_config, shallow

# The smoke on the shallow model (conftest.SHALLOW: 3 layers), swept at its first and last layer.
LAYERS = (0, 2)


@pytest.mark.slow
def test_severity_curve_smoke(tmp_path, sft_cache):
    from aqn_jax.launch import run

    config = shallow(load_config("severity", "smoke"), **{"severity.layers": str(LAYERS)})
    config.sft.cache_dir = sft_cache
    run(config, str(tmp_path / "sev"))
    out = json.loads((tmp_path / "sev" / "severity.json").read_text())
    assert out["n"] == 8 and out["clean"]["loss"] > 0
    pdep = out["prompt_dependence"]
    assert set(pdep) == {"n", "acc", "acc_redrawn", "answered_original", "shared_completion"}
    assert pdep["acc"] == out["clean"]["acc"]  # the same greedy decode of the same problems
    points = {(p["severity"], p["value"], p["layer"]): p for p in out["points"]}
    assert set(points) == {(m, v, k) for m, v in (("amax", 0.1), ("quantile", 0.5)) for k in LAYERS}
    for layer in LAYERS:
        # floor(0.5 n) of n values per held-out batch, less the ties at the threshold (padding
        # positions repeat their hidden states): half, to 1e-3.
        assert points[("quantile", 0.5, layer)]["flushed"] == pytest.approx(0.5, abs=1e-3)
        assert 0.0 < points[("amax", 0.1, layer)]["flushed"] < 0.5
        # The fault changes the loss (negative control: the clean row is not reused).
        assert points[("quantile", 0.5, layer)]["loss"] != out["clean"]["loss"]
    table = (tmp_path / "sev" / "severity.md").read_text()
    assert "| quantile 0.5 |" in table and "/ 50% |" in table


@pytest.mark.slow
def test_severity_without_accuracy_decodes_nothing(tmp_path, monkeypatch, sft_cache):
    """`severity.accuracy=False`: loss and flushed fraction only; no greedy decode, the
    prompt-dependence control included (it decodes too)."""
    from aqn_jax.jobs import severity
    from aqn_jax.launch import run

    def no_decoding(*a, **k):
        raise AssertionError("decoded with config.severity.accuracy=False")

    monkeypatch.setattr(severity, "prompt_dependence", no_decoding)
    monkeypatch.setattr(severity, "eval_scores", no_decoding)
    config = shallow(load_config("severity", "smoke"), **{"severity.layers": str(LAYERS)})
    config.sft.cache_dir = sft_cache
    config.severity.accuracy = False
    config.severity.quantile = ()
    run(config, str(tmp_path / "sev"))
    out = json.loads((tmp_path / "sev" / "severity.json").read_text())
    assert "prompt_dependence" not in out and out["clean"]["acc"] is None
    assert out["points"] and all(p["acc"] is None and p["loss"] > 0 for p in out["points"])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("quantile", (0.5, 1.0), r"config.severity.quantile has 1.0; each must be in \(0, 1\)"),
        ("amax", (0.0,), r"config.severity.amax has 0.0"),
        ("layers", "9", r"config.severity.layers='9' but the model has 8 layers"),
    ],
)
def test_bad_input_fails_before_the_warm_start(tmp_path, field, value, message):
    from aqn_jax.launch import run

    config = load_config("severity", "smoke")
    config.sft.cache_dir = str(tmp_path / "cache")
    config.severity[field] = value
    with pytest.raises(ValueError, match=message):
        run(config, str(tmp_path / "sev"))
    assert not (tmp_path / "cache").exists()
