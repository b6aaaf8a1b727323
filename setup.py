"""Build of the optional C++ extension `cod_fast._cpp` (the CPU kernels in csrc/cpu/).

It also lists the packages, found on disk (a new subpackage can never be left out of a wheel):
`cod_fast` and every package under it, and the top-level kernels/ and bench/ folders with their
subpackages, installed as `cod_fast.kernels` and `cod_fast.bench` (pyproject.toml maps the
folders). Everything else about the package lives in pyproject.toml. The extension is optional: when it
fails to compile (no compiler, no OpenMP), the package still installs and the pure-torch
implementation runs instead. It depends on pybind11 only, never on torch headers, so the isolated
build environment stays small. No -march=native: the kernels carry their own AVX-512 / AVX2 / SSE2
clones (see rows.cpp), so one build runs on every x86-64 machine.
"""

import sys

from setuptools import Extension, find_packages, setup

INSTALLED_AS = {"kernels": "cod_fast.kernels", "bench": "cod_fast.bench"}
"""Top-level folders that install under another name (pyproject.toml's package-dir)."""


def packages() -> list[str]:
    """Every package of the distribution: folders with an __init__.py, found on disk."""
    found = find_packages(include=["cod_fast", "cod_fast.*"])
    for folder, name in INSTALLED_AS.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


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

setup(packages=packages(), ext_modules=extensions)
