"""What the Triton kernels cost a GPU, read from the compiler: no GPU needed.

    python -m cod_fast.bench.kernel_resources [--arch 90] [--kernels NAME,...] [--out DIR]

Triton compiles for any NVIDIA target without a device (its own ptxas does the last step), so
this compiles every kernel of kernels/ at the launch configuration its launcher uses on CUDA,
then asks ptxas for registers and spill bytes. A kernel that does not compile for Hopper, needs
more shared memory than a block may have, or spills registers shows up here on a CPU machine,
before anyone holds a GPU. Tensor-core use is read from the Triton GPU IR (`warp_group_dot` is
Hopper's wgmma).

Output: a table and, as the last stdout line, one JSON object (also DIR/kernel_resources.json).
Run it with TRITON_INTERPRET unset: under the interpreter nothing is compiled.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Per block, sm_80 and sm_90 allow up to 227 KiB of shared memory (opt-in above 48 KiB).
MAX_SHARED_BYTES = 227 * 1024
# Scalars every kernel takes as 32-bit integers; other scalars are float32, pointers *fp32.
INT_ARGS = {
    "N",
    "V",
    "H",
    "stride_hn",
    "stride_wv",
    "stride_z",
    "stride_dz",
    "split_size",
    "num_splits",
}


@dataclass
class KernelCase:
    """One kernel at one launch configuration."""

    name: str
    kernel: str
    """`module:function` inside cod_fast.kernels."""
    constexprs: dict
    options: dict
    types: dict = field(default_factory=dict)
    """Argument types other than the defaults (see INT_ARGS)."""


def cases() -> list[KernelCase]:
    """Every kernel at the configuration its launcher picks on CUDA (no autotuning)."""
    from cod_fast.kernels import linear_lse, rows
    from cod_fast.ops.loss_terms import KL_CODES, POLICY_CODES

    targets = {"y_ptr": "*i64"}
    row = {"BLOCK_V": rows.GPU_BLOCK_V, "NARROW_DZ": False}
    row_launch = {"num_warps": rows.GPU_NUM_WARPS}
    # dz stored as bf16 over the float32 logits, as the driver asks for with bf16 operands.
    narrow = {"NARROW_DZ": True}
    narrow_types = {**targets, "dz_ptr": "*bf16"}
    lse = dict(WITH_ENTROPY=True, EVEN_K=True, UPCAST_OPERANDS=False, GROUP_SIZE=8)
    out = [
        KernelCase(
            "linear_lse_fwd_bf16",
            "linear_lse:_linear_lse_fwd_kernel",
            {**lse, "DOT_PRECISION": "tf32", **linear_lse.GPU_BLOCKS},
            dict(linear_lse.GPU_LAUNCH),
            {**targets, "h_ptr": "*bf16", "w_ptr": "*bf16"},
        ),
        KernelCase(
            "linear_lse_fwd_fp32",
            "linear_lse:_linear_lse_fwd_kernel",
            {**lse, "DOT_PRECISION": "ieee", **linear_lse.GPU_BLOCKS_FP32},
            dict(linear_lse.GPU_LAUNCH),
            targets,
        ),
        KernelCase(
            "linear_lse_combine",
            "linear_lse:_linear_lse_combine_kernel",
            {"WITH_ENTROPY": True, "BLOCK_S": 16, "BLOCK_N": linear_lse.COMBINE_ELEMENTS // 16},
            {},
        ),
        KernelCase(
            "rows_forward",
            "row_kernels:_rows_forward_kernel",
            {"BLOCK_V": rows.GPU_BLOCK_V},
            row_launch,
            targets,
        ),
        KernelCase(
            "rows_backward",
            "row_kernels:_rows_backward_kernel",
            {**row, "HAS_LOGP_GRAD": True, "HAS_ENTROPY_GRAD": True},
            row_launch,
            targets,
        ),
        KernelCase(
            "rows_backward_bf16dz",
            "row_kernels:_rows_backward_kernel",
            {**row, **narrow, "HAS_LOGP_GRAD": True, "HAS_ENTROPY_GRAD": True},
            row_launch,
            narrow_types,
        ),
    ]
    # Every policy and every KL once, with the sequence-level and on-policy switches flipped.
    for policy, kl, seq_level, on_policy in (
        ("ppo", "k3", False, False),
        ("rec_one_side", "k1", True, False),
        ("rec_one_side_is", "k2", False, True),
        ("opd", None, False, False),
    ):
        switches = dict(
            POLICY=POLICY_CODES[policy],
            SEQ_LEVEL=seq_level,
            ON_POLICY=on_policy,
            KL=KL_CODES[kl],
            HAS_ADV=True,
            HAS_ENTROPY_GRAD=True,
            HAS_ENT_VEC=False,
        )
        out.append(
            KernelCase(
                f"rows_fused_{policy}_kl{kl or 'off'}",
                "row_kernels:_rows_fused_kernel",
                {**switches, **row},
                row_launch,
                targets,
            )
        )
    # The largest head (ppo with k3, off policy) once more with bf16 dz.
    ppo = next(case for case in out if case.name == "rows_fused_ppo_klk3")
    out.append(
        KernelCase(
            "rows_fused_ppo_klk3_bf16dz",
            ppo.kernel,
            {**ppo.constexprs, **narrow},
            row_launch,
            narrow_types,
        )
    )
    # ... and with a per-token entropy weight (algo.loss.update_entropy_coef).
    out.append(
        KernelCase(
            "rows_fused_ppo_klk3_entvec",
            ppo.kernel,
            {**ppo.constexprs, "HAS_ENT_VEC": True},
            row_launch,
            targets,
        )
    )
    return out


def compile_case(case: KernelCase, arch: int) -> dict:
    """Compile one case for sm_`arch`; its shared memory, registers, spills and wgmma use."""
    import importlib

    import triton
    import triton.backends.nvidia.compiler as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = case.kernel.split(":")
    fn = getattr(importlib.import_module(f"cod_fast.kernels.{module}"), name)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(
            f"{case.kernel} is not a compilable @triton.jit function (TRITON_INTERPRET=1 makes "
            f"every kernel an interpreted one); run with TRITON_INTERPRET unset"
        )

    def arg_type(arg: str) -> str:
        if arg in case.constexprs:
            return "constexpr"
        if arg in case.types:
            return case.types[arg]
        if arg.endswith("_ptr"):
            return "*fp32"
        return "i32" if arg in INT_ARGS else "fp32"

    signature = {arg: arg_type(arg) for arg in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in case.constexprs.items()}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options=case.options,
    )
    report = _ptxas_report(compiled.asm["ptx"], nvidia.get_ptxas(arch).path, arch)
    return {
        "kernel": case.name,
        "arch": f"sm_{arch}",
        "shared_bytes": int(compiled.metadata.shared),
        **report,
        "wgmma": "warp_group_dot" in compiled.asm["ttgir"],
        "num_warps": int(compiled.metadata.num_warps),
        "num_stages": int(compiled.metadata.num_stages),
    }


def _ptxas_report(ptx: str, ptxas: str, arch: int) -> dict:
    """Registers and spill bytes of a kernel's PTX, from `ptxas -v`."""
    suffix = "a" if arch == 90 else ""  # Triton emits sm_90a PTX for Hopper
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", str(src), "-o", str(src) + ".o"],
            capture_output=True,
            text=True,
            check=True,
        )
    log = result.stderr

    def number(pattern: str) -> int:
        match = re.search(pattern, log)
        if match is None:
            raise RuntimeError(f"ptxas -v printed no {pattern!r}:\n{log}")
        return int(match.group(1))

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
    }


def main(argv: list[str] | None = None) -> dict:
    from cod_fast.bench.harness import emit_summary

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--kernels", default="", help="comma-separated case names (all if empty)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 turns the kernels into interpreted ones; unset it")
    wanted = {k for k in args.kernels.split(",") if k}
    chosen = [c for c in cases() if not wanted or c.name in wanted]
    unknown = wanted - {c.name for c in chosen}
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {[c.name for c in cases()]}")
    rows = []
    print(f"{'kernel':34} {'shared':>8} {'regs':>5} {'spill st/ld':>12} {'wgmma':>6}")
    for case in chosen:
        row = compile_case(case, args.arch)
        rows.append(row)
        spills = f"{row['spill_store_bytes']}/{row['spill_load_bytes']}"
        print(
            f"{row['kernel']:34} {row['shared_bytes']:>8} {row['registers']:>5} "
            f"{spills:>12} {row['wgmma']!s:>6}",
            flush=True,
        )
    return emit_summary(
        {"max_shared_bytes": MAX_SHARED_BYTES, "kernels": rows}, args.out / "kernel_resources.json"
    )


if __name__ == "__main__":
    main()
