"""Which CPU kernels this process runs, and whether they round differently from another choice.

``python tests/cpu_kernels.py`` prints torch's vectorised-kernel capability (``ATEN_CPU_CAPABILITY``
chooses it), the BLAS torch calls for matmul, and a digest of the float32 bits of a matmul, a
softmax, a reduction and an attention, so two environments can be compared::

    ATEN_CPU_CAPABILITY=default python tests/cpu_kernels.py
    MKL_ENABLE_INSTRUCTIONS=AVX2 python tests/cpu_kernels.py

Two runs whose digests differ round differently: the numeric tests must pass under both
(``make test-kernels``).
"""

from __future__ import annotations

import hashlib
import os

import torch


def digests() -> dict[str, str]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 333, generator=g), torch.randn(333, 77, generator=g)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    ops = {
        "matmul": lambda: a @ b,
        "softmax": lambda: torch.softmax(a * 7.1, -1),
        "sum": lambda: a.exp().sum(-1),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    return {name: hashlib.sha1(op().numpy().tobytes()).hexdigest()[:10] for name, op in ops.items()}


def main() -> None:
    torch.set_num_threads(1)
    env = {
        k: os.environ[k]
        for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
        if k in os.environ
    }
    blas = "MKL" if torch.backends.mkl.is_available() else "OpenBLAS or other"
    print(f"env {env or '{}'}  capability {torch.backends.cpu.get_cpu_capability()}  blas {blas}")
    print("  ".join(f"{k} {v}" for k, v in digests().items()))


if __name__ == "__main__":
    main()
