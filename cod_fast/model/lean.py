"""Memory-lean SwiGLU MLP and RMSNorm for Hugging Face decoders (Qwen3, Qwen2, Llama, Mistral).

Without gradient checkpointing, a training step's memory beyond the weights is the activations
autograd saves for the backward pass. transformers' modules save more than the backward needs:

- `down_proj(act_fn(gate_proj(x)) * up_proj(x))` keeps four [T, I] tensors per layer: the gate
  (for SiLU's backward), SiLU(gate) and up (for the product's), and the product (for
  down_proj's weight gradient). `swiglu_down` keeps the gate and up only and recomputes the
  other two in the backward pass (elementwise work, no matmul).
- `weight * (x * rsqrt(mean(x^2) + eps))` keeps x and the normalised x, two [T, H] tensors.
  `rms_norm` keeps x and the [T] reciprocal RMS.

Per token and layer that is 2*I + H + H + (q and k head widths) fewer floats: for the trainer
benchmark's 4-layer H=512 I=1536 model, 78 KB per token (measured there: 1058 -> 713 MiB for a
5.3k-token micro-batch, 69 KB per token). The arithmetic is cod_fast.ops.layers': float32 on a
CPU runs its C++ kernels (one pass each, equal to transformers' values up to rounding); elsewhere,
and with `COD_FAST_IMPL=torch`, the same operations in the same order as transformers', so the
forward values are bitwise equal in float32 and 16-bit dtypes. The gradients agree to rounding
(tests compare both against float64).

`make_lean(model)` rebinds `forward` of the modules whose code it knows (by class, and only with
the SiLU activation and no bias); everything else, and every parameter, stays as it was, so
`state_dict`, FSDP2 and `save_pretrained` see the same model.
"""

from __future__ import annotations

import types

import torch

from cod_fast.ops.layers import rms_norm, swiglu_down

MLP_CLASSES = ("Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP")
NORM_CLASSES = ("Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")


def _lean_mlp_forward(self, x):
    return swiglu_down(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def _lean_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_is_swiglu(module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    linear = all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projections)
    return act == "silu" and linear


def make_lean(model) -> dict[str, int]:
    """Rebind the forward of `model`'s SwiGLU MLPs and RMSNorms to the lean autograd functions.
    Returns how many modules of each kind were changed (zero for an architecture not known)."""
    changed = {"mlp": 0, "norm": 0}
    for module in model.modules():
        name = type(module).__name__
        if name in MLP_CLASSES and _mlp_is_swiglu(module):
            module.forward = types.MethodType(_lean_mlp_forward, module)
            changed["mlp"] += 1
        elif name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_lean_norm_forward, module)
            changed["norm"] += 1
    return changed
