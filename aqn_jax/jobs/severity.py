"""Job `severity`: the deadzone severity curve of a policy before any RL. For each decoder layer
x each severity (fractions of amax, the original's statement, and quantiles, the flushed
fraction): the fraction of the layer's output flushed, the held-out loss of the worked
solutions and the greedy accuracy on the faulty device; plus the clean baseline and, on the
embedded task, the prompt-dependence control (`evaluation.prompt_dependence`). With
`config.severity.accuracy=False` nothing is decoded: loss and flushed fraction only.

  python -m aqn_jax.launch --config=configs/severity.py
  python -m aqn_jax.launch --config=configs/severity.py --config.severity.accuracy=False \
      --config.model.hf_path=/models/SmolLM2-135M-Instruct --config.sft.enabled=False

One compiled program per severity statement serves every layer and value: the deadzone sits on
every layer with a traced per-layer factor (0 = off: a threshold of 0 flushes nothing), so the
curve costs evaluations, not compiles. The flushed fraction is measured teacher-forced on the
held-out batches (the module's whole padded tensor, as the fault sees it). The fault's site,
point, granularity and gradient come from config.faults.deadzone; its layers and severity from
config.severity. Writes `severity.json` and `severity.md` into the workdir.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import NamedTuple

import jax
import numpy as np

from aqn_jax.checks import check_instruction
from aqn_jax.data.config import check_data, load_split, task_of, with_prompt_format
from aqn_jax.evaluation import greedy_sampling, heldout_loss, prompt_dependence
from aqn_jax.faults.config import POINTS
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key, summarize_stats
from aqn_jax.faults.sites import SiteSelector, expand_kinds
from aqn_jax.faults.transforms import Deadzone
from aqn_jax.files import write_json
from aqn_jax.forward import token_nll
from aqn_jax.models.factory import model_config
from aqn_jax.models.registry import causal_lm, layer_name
from aqn_jax.rl.sampler import Sampler
from aqn_jax.rl.scoring import eval_scores
from aqn_jax.rl.sft import sft_sequences
from aqn_jax.spec import decode_spec, warm_start_spec
from aqn_jax.study.config import check_severity
from aqn_jax.warm_start import tokenizer_for, warm_start

FACTOR = "severity_layer_factor"  # the traced per-layer factor of the swept deadzone
BASE = 0.5  # the Deadzone's own threshold; a point's value v is the factor v / BASE


def run(config, workdir: str) -> None:
    """The job's stages: check (nothing is compiled or written before it passes), the warm
    start, the clean baseline, the sweep over severity x layer, the report."""
    checked = _check(config)
    t0 = time.perf_counter()
    model_cfg, params, _ = warm_start(warm_start_spec(config), workdir)
    ev = _Eval.of(config, model_cfg, params, checked.tokenizer, checked.test)
    out = _baseline(config, ev, model_cfg, checked.size)
    print(_clean_line(out))
    _sweep(ev, checked, out["points"])
    out["wall_time_s"] = time.perf_counter() - t0
    if jax.process_index() == 0:
        _write(workdir, out)
    print(f"severity curve: {os.path.join(workdir, 'severity.md')}")


class _Checked(NamedTuple):
    """The checked config: what the sweep covers and the held-out examples."""

    n_layers: int
    layers: list
    points: list  # (severity statement, value)
    kinds: tuple  # the deadzone's module kinds
    point: str  # the deadzone's point
    transforms: dict  # severity statement -> its Deadzone
    tokenizer: object
    size: int
    test: list


def _check(config) -> _Checked:
    """Every check that needs no compile; the swept transforms and the held-out examples."""
    model_cfg = model_config(config.model)
    n_layers = model_cfg.num_hidden_layers
    layers, points = check_severity(config.severity, n_layers)
    check_data(config.data)
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    check_instruction(config.data, tokenizer)
    dz = config.faults.deadzone
    kinds = expand_kinds((dz.site,) if isinstance(dz.site, str) else tuple(dz.site), "site")
    if dz.point not in POINTS:
        raise ValueError(f"config.faults.deadzone.point={dz.point!r}; allowed: {POINTS}")
    transforms = {}
    for mode in sorted({m for m, _ in points}):
        try:
            transforms[mode] = Deadzone(
                BASE,
                granularity=dz.granularity,
                grad=dz.grad,
                severity=mode,
                scope=dz.scope,  # the run's scope, as SRDD and evaluation use
                threshold_value=FACTOR,
            )
        except ValueError as e:
            raise ValueError(f"config.faults.deadzone.{e}") from e
    size = int(config.severity.size or config.trainer.val_size)
    test = load_split(config.data, "test")[:size]
    return _Checked(n_layers, layers, points, kinds, dz.point, transforms, tokenizer, size, test)


@dataclasses.dataclass
class _Eval:
    """What every point of the curve is measured with, and one Sampler (one compiled program)
    per fault plan: every layer and value is a traced input."""

    model: object
    params: object
    tokenizer: object
    test: list
    bs: int
    key: jax.Array
    sampling: object
    buckets: tuple
    limit: int
    accuracy_on: bool
    reward_method: str
    samplers: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, config, model_cfg, params, tokenizer, test) -> _Eval:
        return cls(
            model=causal_lm(dataclasses.replace(model_cfg, remat=False)),
            params=params,
            tokenizer=tokenizer,
            test=test,
            bs=int(config.trainer.val_batch_size),
            key=step_key(int(config.seed), 0, "eval"),
            sampling=greedy_sampling(config.rollout.max_new_tokens, tokenizer),
            buckets=tuple(int(b) for b in config.rollout.prompt_buckets),
            limit=int(config.rollout.max_prompt_len),
            accuracy_on=bool(config.severity.accuracy),
            reward_method=config.data.reward_method,
        )

    def accuracy(self, plan, values) -> float | None:
        """Greedy accuracy on the held-out examples; None with config.severity.accuracy off."""
        if not self.accuracy_on:
            return None
        if repr(plan.injections) not in self.samplers:
            self.samplers[repr(plan.injections)] = Sampler(
                self.model, self.sampling, plan, self.buckets, phase="eval"
            )
        sampler = self.samplers[repr(plan.injections)]
        scores = eval_scores(
            sampler,
            self.params,
            self.test,
            self.tokenizer,
            self.bs,
            self.limit,
            self.key,
            values,
            self.key,
            method=self.reward_method,
        )
        return float(np.mean(scores))

    def loss(self, plan) -> float:
        return heldout_loss(
            self.model, self.params, plan, self.test, self.tokenizer, self.bs, self.key
        )


def _baseline(config, ev: _Eval, model_cfg, size: int) -> dict:
    """The report's head: the clean loss and accuracy, and on the embedded task the
    prompt-dependence control (greedy decoding, as accuracy)."""
    clean = {"loss": ev.loss(FaultPlan())}
    clean["acc"] = ev.accuracy(FaultPlan(), {})
    out = {"model": config.model.to_dict(), "n": len(ev.test), "clean": clean, "points": []}
    if config.severity.accuracy and not config.data.train_path:
        spec, task = decode_spec(config), task_of(config.data)
        out["prompt_dependence"] = prompt_dependence(
            spec,
            task,
            model_cfg,
            ev.params,
            ev.tokenizer,
            size,
            lambda examples: with_prompt_format(examples, config.data, "test"),
        )
    return out


def _sweep(ev: _Eval, c: _Checked, rows: list) -> None:
    """Each severity x value x layer: the flushed fraction, the loss and the accuracy,
    appended to `rows` and printed as they come."""
    data = sft_sequences(c.test, ev.tokenizer)
    for mode, transform in c.transforms.items():
        plan = FaultPlan(
            [Injection("deadzone", SiteSelector(c.kinds, "all", c.point), transform, ("eval",))]
        )
        plan.validate(c.n_layers)
        stats_fn = _stats_program(ev.model, plan)
        for _, value in [p for p in c.points if p[0] == mode]:
            for layer in c.layers:
                factor = np.zeros(c.n_layers, np.float32)
                factor[layer] = value / BASE
                values = {FACTOR: factor}
                name = layer_name(ev.model.config, layer)
                loss, flushed = _loss_and_flushed(
                    stats_fn, ev.params, data, ev.bs, ev.key, values, name
                )
                row = {
                    "severity": mode,
                    "value": value,
                    "layer": layer,
                    "flushed": flushed,
                    "loss": loss,
                    "acc": ev.accuracy(plan, values),
                }
                rows.append(row)
                print(_point_line(row), flush=True)


def _stats_program(model, plan):
    @jax.jit
    def fn(params, ids, mask, loss_mask, key, values):
        nll, state = token_nll(
            model,
            params,
            ids,
            mask,
            loss_mask,
            plan=plan,
            phase="eval",
            key=key,
            values=values,
            mutable=["fault_stats"],
        )
        return (*nll, state["fault_stats"])

    return fn


def _loss_and_flushed(fn, params, data, bs, key, values, layer_name: str):
    total = count = 0.0
    flushed, weights = [], []
    for start in range(0, len(data.ids), bs):
        sl = slice(start, start + bs)
        s, c, stats = fn(
            params,
            data.ids[sl],
            data.mask[sl],
            data.loss_mask[sl],
            jax.random.fold_in(key, start),
            values,
        )
        total, count = total + float(s), count + float(c)
        flushed.append(summarize_stats(stats)[f"deadzone.flushed/{layer_name}"])
        weights.append(len(data.ids[sl]))
    return total / max(count, 1.0), float(np.average(flushed, weights=weights))


def _fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def _clean_line(out):
    c = out["clean"]
    line = f"clean: loss {c['loss']:.3f}, acc {_fmt(c['acc'], '.3f')}"
    pdep = out.get("prompt_dependence")
    if pdep:
        line += (
            f"; numbers redrawn: acc {pdep['acc_redrawn']:.3f}; completions shared across"
            f" answers: {pdep['shared_completion']:.3f}"
        )
    return line


def _point_line(r):
    return (
        f"  {r['severity']}={r['value']:g} layer {r['layer']}: flushed {100 * r['flushed']:.1f}%,"
        f" loss {r['loss']:.3f}, acc {_fmt(r['acc'], '.3f')}"
    )


def _write(workdir: str, out: dict) -> None:
    write_json(os.path.join(workdir, "severity.json"), out)
    layers = sorted({p["layer"] for p in out["points"]})
    lines = [
        "# Deadzone severity curve (before RL)",
        "",
        _clean_line(out),
        "",
        "Each cell: greedy accuracy / held-out loss / share of the layer's output flushed.",
        "",
        "| severity | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
        "|---|" + "---|" * len(layers),
    ]
    keys = sorted({(p["severity"], p["value"]) for p in out["points"]})
    for mode, value in keys:
        cells = []
        for layer in layers:
            (p,) = [
                q
                for q in out["points"]
                if (q["severity"], q["value"], q["layer"]) == (mode, value, layer)
            ]
            cells.append(f"{_fmt(p['acc'], '.3f')} / {p['loss']:.2f} / {100 * p['flushed']:.0f}%")
        lines.append(f"| {mode} {value:g} | " + " | ".join(cells) + " |")
    with open(os.path.join(workdir, "severity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
