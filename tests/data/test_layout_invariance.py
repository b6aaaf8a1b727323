"""docs/concepts.md section 5's invariant: prefix-merged and one-sequence-per-turn layouts of the
same rollout give the same loss and the same gradients (a tiny random transformer over both)."""

from __future__ import annotations

import random

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.data.packing import build_microbatch, rollout_sequences
from cod_fast.data.records import Episode, Turn
from cod_fast.ops import linear_policy_loss
from tests.tiny_transformer import TinyPackedTransformer

VOCAB = 50


def random_episode(rng: random.Random, pack_id: int, kind: str, task: int) -> Episode:
    """A multi-turn episode whose turns only append: prompt_{j+1} = prompt_j + response_j + obs."""
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    turns = []
    for _ in range(rng.randint(1, 4)):
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        turns.append(
            Turn(
                prompt_ids=list(prompt),
                response_ids=response,
                response_logprobs=[-rng.random() * 3 for _ in response],
            )
        )
        prompt = prompt + response + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
    return Episode(
        pack_id=pack_id,
        member=0,
        kind=kind,
        task_index=task,
        turns=turns,
        reward=rng.random(),
        advantage=rng.gauss(0, 1),
    )


def loss_and_grads(model, sequences, cfg):
    mb = build_microbatch(sequences)
    model.zero_grad()
    hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
    out = linear_policy_loss(
        hidden[mb.trainable_idx],
        model.lm_head.weight,
        mb.targets,
        mb.advantages,
        mb.segment_ids,
        rollout_logp=mb.rollout_logp,
        loss_config=cfg,
    )
    out.loss.backward()
    per_segment = {
        key: sorted(out.logp[mb.segment_ids == i].tolist()) for i, key in enumerate(mb.segment_keys)
    }
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, per_segment


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(policy="rec_one_side", ratio_level="sequence", agg="seq-mean-token-mean"),
        LossConfig(policy="ppo", agg="seq-mean-token-sum-norm", max_response_len=8),
    ],
    ids=["ppo-token-mean", "rec-sequence-seqmean", "ppo-sumnorm"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_and_per_turn_layouts_agree(cfg, seed):
    """Same loss, same per-segment log-probs and same parameter gradients in both layouts."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = TinyPackedTransformer(vocab=VOCAB).double()
    episodes = [
        random_episode(rng, p, kind, k)
        for p in range(2)
        for k in range(3)
        for kind in ("solve", "update")
    ]
    merged = rollout_sequences(episodes, merge_prefix=True)
    split = rollout_sequences(episodes, merge_prefix=False)
    assert len(merged) == len(episodes) < len(split)  # the layouts really differ
    loss_m, grads_m, logp_m = loss_and_grads(model, merged, cfg)
    loss_s, grads_s, logp_s = loss_and_grads(model, split, cfg)
    torch.testing.assert_close(loss_m, loss_s, rtol=1e-10, atol=1e-12)
    assert logp_m.keys() == logp_s.keys()
    for key in logp_m:
        torch.testing.assert_close(torch.tensor(logp_m[key]), torch.tensor(logp_s[key]))
    for name in grads_m:
        torch.testing.assert_close(
            grads_m[name],
            grads_s[name],
            rtol=1e-9,
            atol=1e-12,
            msg=lambda m, n=name: f"gradient of {n}: {m}",
        )
