"""Build of the optional C++ extension `cod_fast._cpp` (the CPU kernels in csrc/cpu/).

Everything else about the package lives in pyproject.toml. The extension is optional: when it
fails to compile (no compiler, no OpenMP), the package still installs and the pure-torch
implementation runs instead. It depends on pybind11 only, never on torch headers, so the isolated
build environment stays small. No -march=native: the kernels carry their own AVX-512 / AVX2 / SSE2
clones (see rows.cpp), so one build runs on every x86-64 machine.
"""

import sys

from setuptools import Extension, setup

try:
    import pybind11
except ImportError:  # only without build isolation: pyproject.toml's build requires pull it in
    pybind11 = None
    print("cod-fast: pybind11 is not installed; skipping the C++ extension", file=sys.stderr)

if sys.platform == "darwin":  # Apple clang needs libomp; without it the build fails (optional)
    openmp_compile, openmp_link = ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
else:
    openmp_compile, openmp_link = ["-fopenmp"], ["-fopenmp"]

extensions = []
if pybind11 is not None:
    extensions.append(
        Extension(
            "cod_fast._cpp",
            ["csrc/cpu/rows.cpp", "csrc/cpu/layers.cpp", "csrc/cpu/attention.cpp"],
            include_dirs=[pybind11.get_include(), "csrc"],
            depends=["csrc/loss_head.h", "csrc/cpu/common.h"],
            language="c++",
            # -ffp-contract=fast lets the AVX2 / AVX-512 clones fuse multiply-adds (ISO -std
            # modes turn it off); -fno-trapping-math lets GCC turn the exp's selects into blends,
            # so the AVX2 and SSE2 loops vectorise too. No -ffast-math: NaN and inf keep their
            # meaning. -g0: no debug info (it would make the module ten times larger).
            extra_compile_args=[
                "-O3",
                "-g0",
                "-std=c++17",
                "-ffp-contract=fast",
                "-fno-trapping-math",
                "-fvisibility=hidden",
                *openmp_compile,
            ],
            extra_link_args=openmp_link,
            optional=True,
        )
    )

setup(ext_modules=extensions)
