"""Kernel families: per-token log-probs and the policy loss from hidden states and the LM head."""

from cod_fast.ops.linear_loss import linear_policy_loss
from cod_fast.ops.logprobs import linear_logprobs
from cod_fast.ops.loss_terms import LossInputs, PolicyLossOutput, aggregation_denominator
from cod_fast.ops.policy_loss import policy_loss_from_logp

__all__ = [
    "LossInputs",
    "PolicyLossOutput",
    "aggregation_denominator",
    "linear_logprobs",
    "linear_policy_loss",
    "policy_loss_from_logp",
]
