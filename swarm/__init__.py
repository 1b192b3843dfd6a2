import os

__version__ = "0.1.0"

# torch's OpenMP threads spin after each parallel op by default. On a home PC's few cores that
# spinning takes the core from the thread that runs next, here the quantized-matmul kernels'
# own pool (swarm/model/kernels): at 2 threads an 8B-shaped layer's decode took 7.3 ms spinning
# against 5.2 passive, its 1-thread time 7.3 (docs/benchmarks.md, "Kernels"). Set before torch
# loads OpenMP, which it does on import: swarm's entry points import this package first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
