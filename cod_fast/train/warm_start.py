"""The supervised warm start's loss.

A tiny model that starts from random weights first imitates the environment's scripted explorer
(demonstrations: cod_fast.rollout.scripted). The warm-start loss is the REC policy loss with
A = 1 (`SFT_LOSS`): a demonstration's log-probs are 0 (a deterministic policy), so every ratio
exp(logp - 0) <= 1 is kept, and -A logp averaged over the tokens is the mean negative
log-likelihood. Both phases run through cod_fast.train.step.
"""

from __future__ import annotations

from cod_fast.config import LossConfig

SFT_LOSS = LossConfig(policy="rec_one_side", eps_low=0.2, eps_high=0.2, agg="token-mean")
