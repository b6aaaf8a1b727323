"""cod-fast: a performance-first RL trainer for 'connect the dots' (CoD) agents.

Importing the package sets `OMP_WAIT_POLICY=PASSIVE` in the environment where the user has not
set `OMP_WAIT_POLICY`: OpenMP worker threads then sleep as soon as their work runs out instead
of spinning for it. The OpenMP runtime torch ships, libgomp (torch/lib/libgomp.so.1, which
libtorch_cpu.so links; cod_fast._cpp resolves to the same loaded copy), reads the variable once,
when it is loaded, so it is set here, before anything of the package imports torch: every entry
point (`cod-fast`, `python -m cod_fast.cli`, each torchrun worker, `import cod_fast`) imports
this module first. A process that imported torch before cod_fast keeps the policy it loaded
with; its child processes get this one.

Why: libgomp's default wait spins, and spinning workers of processes that share cores (a seed
sweep, a trainer beside a rollout worker, a CI machine) take the cores from the threads with
work. Measured on a 2-vCPU AMD EPYC: three tiny-cpu runs of 150 warm-start steps at once took
226 s with libgomp's default policy and torch's default threads, 55 s with PASSIVE (51 s with
one thread each); one run alone took 24-26 s with either policy. `cod-fast bench concurrent`
measures it again.
"""

import os

# Before the package's first import: nothing may load libgomp before this line.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cod_fast.config import LossConfig

__version__ = "0.1.0"

__all__ = ["LossConfig", "__version__"]
