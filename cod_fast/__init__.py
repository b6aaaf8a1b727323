"""cod-fast: a performance-first RL trainer for 'connect the dots' (CoD) agents.

Importing the package shortens how long idle OpenMP workers spin before they sleep: it sets
`GOMP_SPINCOUNT=10000` where the user has set neither `GOMP_SPINCOUNT` nor `OMP_WAIT_POLICY`
(libgomp's own default spins 300000 times, a few milliseconds, per wait). The OpenMP runtime
torch ships, libgomp (torch/lib/libgomp.so.1, which libtorch_cpu.so links; cod_fast._cpp
resolves to the same loaded copy), reads the variables once, when it is loaded, so they are set
here, before anything of the package imports torch: every entry point (`cod-fast`, `python -m
cod_fast.cli`, each torchrun worker, `import cod_fast`) imports this module first. A process that
imported torch before cod_fast keeps the policy it loaded with; its child processes get this one.

Why: spinning workers of processes that share cores (a seed sweep, a trainer beside a rollout
worker, a CI machine) take the cores from the threads with work, and workers that sleep at once
(`OMP_WAIT_POLICY=PASSIVE`) slow a run alone, which wakes them thousands of times a second.
Measured with `cod-fast bench concurrent` on a quiet 2-vCPU Intel Xeon (2026-12-07; tiny-cpu,
150 warm-start steps, torch's default threads): one run alone took 22.0 s with libgomp's
default, 27.5 s with PASSIVE and 21.8-22.2 s with this spin count; three runs at once took
201.5 s, 53.5 s and 61.3-61.7 s, against 66-83 s for the three one after another.
"""

import os

# Before the package's first import: nothing may load libgomp before this line.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from cod_fast.config import LossConfig

__version__ = "0.1.0"

__all__ = ["LossConfig", "__version__"]
