"""`config.model.dtype='auto'`: bf16 compute where it is faster on the machine at hand.

On an accelerator bf16 products are the fast path: 'auto' is bfloat16. On a CPU it depends on the
chip (AMX-BF16 or AVX512-BF16 make bf16 products faster, AVX2 alone slower), so 'auto' times the
decoder's widest product (M=256 rows x 896 x 4864, f32 accumulation) in both dtypes, the best of
15 alternating rounds after a warm-up (~1 s), and takes bfloat16 only when it is at least
`MIN_SPEEDUP` faster. The choice and its measurement are printed with the run's log and written
into config.json as the resolved dtype (a run resumes with what it chose; `launch.resolve_dtype`).

The master weights and the optimizer state stay `config.model.param_dtype` (float32); bf16 changes
the forward's numerics, which is why the embedded default keeps float32 and 'auto' is opt-in per
config.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

AUTO = "auto"
MIN_SPEEDUP = 1.15  # below this, bf16's different numerics are not worth it
SHAPE = (256, 896, 4864)  # M x K x N: the 0.5B MLP's up projection over 256 rows
# Alternating rounds of the probe (~0.5 s on 2 cores): a change of the machine's load during
# the probe falls on both dtypes alike (timing one dtype's calls and then the other's lets it
# decide).
ROUNDS = 15


# The CPU flags that decide bf16 and f32 matmul speed (`avx512_bf16`: native bf16 dot
# products; `amx_bf16`: tiles; without either XLA converts bf16 operands to f32).
BF16_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> tuple[str, ...] | None:
    """Those of `BF16_FLAGS` this CPU has (/proc/cpuinfo); None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(x for x in BF16_FLAGS if x in have)
    except OSError:
        pass
    return None


def machine_class() -> str:
    """This CPU's class as the study pairs seeds on it: the model name, family and model of
    /proc/cpuinfo's first processor and `cpu_flags` (XLA:CPU's f32 results differ between
    classes, so a seed's arms run on one)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    flags = ",".join(cpu_flags() or ()) or "none of avx2/avx512/amx"
    return (
        f"{info.get('model name', 'unknown')}, family {info.get('cpu family', '?')} model"
        f" {info.get('model', '?')}; flags {flags}"
    )


def _best_times(dtypes, rounds: int = ROUNDS) -> list[float]:
    """The best time of the product in each of `dtypes`, timed in alternating rounds (each round
    times every dtype once, in turn) so that a change of the machine's load during the probe
    falls on all of them alike; the best of many calls is what the chip can do."""
    m, k, n = SHAPE
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    args = [(jnp.asarray(a, dt), jnp.asarray(b, dt)) for dt in dtypes]
    for x, y in args:
        dot(x, y).block_until_ready()
    best = [float("inf")] * len(dtypes)
    for _ in range(rounds):
        for i, (x, y) in enumerate(args):
            t0 = time.perf_counter()
            dot(x, y).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def choose(backend: str | None = None) -> tuple[str, str]:
    """(the compute dtype for 'auto', the reason as one line); measured once per process."""
    return _choose(backend or jax.default_backend())


@functools.cache
def _choose(backend: str) -> tuple[str, str]:
    if backend != "cpu":
        return "bfloat16", f"on {backend}: bf16 products are the accelerator's fast path"
    t32, t16 = _best_times((jnp.float32, jnp.bfloat16))
    speedup = t32 / t16
    flags = ",".join(cpu_flags() or ()) or "unknown"
    m, k, n = SHAPE
    measured = (
        f"a {m}x{k}x{n} product takes {t16 * 1e3:.1f} ms in bf16 and {t32 * 1e3:.1f} ms in f32"
        f" ({speedup:.2f}x; CPU flags {flags})"
    )
    if speedup >= MIN_SPEEDUP:
        return "bfloat16", f"{measured} >= {MIN_SPEEDUP}x"
    return "float32", f"{measured} < {MIN_SPEEDUP}x"


def resolve(dtype: str, log=print) -> str:
    """`dtype` (config.model.dtype), with 'auto' replaced by the chosen dtype (and why logged);
    an explicit dtype as it is."""
    if dtype != AUTO:
        return dtype
    chosen, why = choose()
    log(f"config.model.dtype=auto -> {chosen}: {why}")
    return chosen
