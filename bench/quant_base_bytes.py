"""A packed NVFP4 / MXFP4 base against bf16: bytes, and what the format changes in the weights.

  python bench/quant_base_bytes.py [--snapshot=DIR ...]   # default: the shipped warm start

For every decoder linear kernel of each snapshot: the packed bytes (`quant_base.pack`: 4-bit
codes + block scales + two scalars) against bf16, the relative Frobenius error ||W_q - W|| /
||W||, and the share of non-zero weights the format flushes to zero. Prints
`BENCH quant_base_bytes ratio=<bf16 bytes / packed bytes> fmt=.. snapshot=..`.
"""

from __future__ import annotations

import argparse
import glob
import os

import numpy as np

from aqn_jax import quant_base
from aqn_jax.models.hf import load_hf_checkpoint
from aqn_jax.models.registry import family_of
from aqn_jax.warm_start import SHIPPED_DIR


def measure(path: str) -> list[dict]:
    cfg, params = load_hf_checkpoint(path, "float32")
    site_of = family_of(cfg).site_of
    kernels = quant_base.linear_kernel_paths(params, site_of)
    out = []
    for fmt in ("nvfp4", "mxfp4"):
        packed = quant_base.pack(params, fmt, site_of)
        num = den = 0.0
        flushed = n = 0
        for p in kernels:
            w = np.asarray(quant_base.leaf_at(params, p), np.float64)
            q = np.asarray(quant_base._dequantize(quant_base.leaf_at(packed, p)), np.float64)
            num += float(((q - w) ** 2).sum())
            den += float((w**2).sum())
            flushed += int(((q == 0) & (w != 0)).sum())
            n += w.size
        nbytes = sum(quant_base.leaf_at(packed, p).nbytes for p in kernels)
        out.append(
            dict(
                fmt=fmt,
                weights=n,
                packed_mib=nbytes / 2**20,
                bf16_mib=2 * n / 2**20,
                rel_error=float(np.sqrt(num / den)),
                flushed=flushed / n,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--snapshot", action="append", default=[])
    args = ap.parse_args()
    paths = args.snapshot or sorted(glob.glob(os.path.join(SHIPPED_DIR, "sft-*")))
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        for r in measure(path):
            print(
                f"BENCH quant_base_bytes ratio={r['bf16_mib'] / r['packed_mib']:.3f}"
                f" fmt={r['fmt']} snapshot={name} weights={r['weights']}"
                f" packed_mib={r['packed_mib']:.2f} bf16_mib={r['bf16_mib']:.2f}"
                f" rel_error={r['rel_error']:.4f} flushed={r['flushed']:.4f}"
            )


if __name__ == "__main__":
    main()
