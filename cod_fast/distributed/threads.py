"""Torch's CPU threads for a run's process (`runtime.threads`).

Two settings decide how a run's OpenMP threads share the cores:

- The wait policy: importing cod_fast shortens libgomp's spin before an idle worker sleeps
  (`GOMP_SPINCOUNT=10000`, unless the user set it or `OMP_WAIT_POLICY`; cod_fast/__init__.py
  says why), so idle workers do not hold cores other processes need.
- The thread count, here: `runtime.threads` null keeps torch's default (one thread per core the
  process may use, or `OMP_NUM_THREADS` where set); N sets N for this process, before its first
  computation (torch's warning in `torch.set_num_threads`: the count must be set before eager,
  JIT or autograd code runs).

Under torchrun: when `OMP_NUM_THREADS` is unset and more than one process runs per node,
torchrun sets it to 1 for every worker (torch/distributed/run.py, `run`), so each rank starts
with one thread; `runtime.threads=N` still gives each rank N. An in-process vLLM engine on the
CPU makes `torch.set_num_threads` a no-op once it is built (cod_fast.rollout.vllm_sampler), so
the count is set before the samplers are.
"""

from __future__ import annotations

import torch


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads of this process to `threads` (None: leave the default), and
    return the count in effect."""
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
