"""The training step that `cod-fast bench train` times (cod_fast.bench.train), shared by the
benchmarks that build the same model, batch or step (launches, profile_step, decode,
e2e_workload).

- The model: a Qwen3-architecture decoder of a given shape (StepShape; TINY for smoke tests) with
  weights from SEED, prepared for training as the trainer prepares it.
- The batch: CoD rollouts of random token ids (per pack, K multi-turn solve episodes and K-1
  long-prompt update episodes), packed into micro-batches as the trainer packs them, with
  rollout log-probs near the initial policy's.
- The two contenders' optimizer step, same loss (LOSS), clip and AdamW: `fused`, the trainer's
  `train_step` over `Policy`, and `logits+eager`, full [T, V] logits, log_softmax, gather, then
  the library's loss on log-probs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from cod_fast.config import LossConfig

CONTENDERS = ("fused", "logits+eager")
LOSS = LossConfig(policy="rec_one_side", eps_high=0.28)  # the CoD runs' loss
GRAD_CLIP, LR, SEED, K = 1.0, 1e-5, 1234, 4  # K: tasks per pack, in both of bench.train's sections


@dataclass(frozen=True)
class StepShape:
    """The model and the batch of the step benchmark."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4  # GQA, as in every Qwen3 model
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 32768
    tokens: int = 16384
    """Packed tokens of the step; episode lengths shrink with it below 16384."""
    micro_batches: int = 3

    def describe(self) -> str:
        return (
            f"Qwen3 {self.layers}L H{self.hidden} {self.heads}q/{self.kv_heads}kv heads "
            f"d{self.head_dim} I{self.intermediate} V{self.vocab} tied"
        )

    def seeded_model(self, **config):
        """Qwen3ForCausalLM of this shape with weights from SEED (the global RNG is left as it
        was); `config` adds Qwen3Config fields (end and padding tokens)."""
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            **config,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return Qwen3ForCausalLM(config)


TINY = StepShape(  # the smoke test's: seconds, not a measurement
    layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=512, tokens=512
)


def cod_episodes(shape: StepShape, seed: int = SEED) -> list:
    """CoD rollouts of random token ids, episodes added while they fit in `shape.tokens`: per
    pack, K solve episodes (a prompt, four short responses, an observation after each) and
    between them K-1 update episodes (a long prompt holding the transcript, one response)."""
    from cod_fast.data.records import Episode, Turn

    rng = random.Random(seed)
    scale = min(1.0, shape.tokens / 16384)
    order = [(kind, k) for k in range(K) for kind in ("solve", "update")][:-1]

    def ids(mean: int) -> list[int]:
        n = max(1, round(mean * scale * rng.uniform(0.8, 1.2)))
        return [rng.randrange(shape.vocab) for _ in range(n)]

    def episode(pack: int, kind: str, k: int) -> Episode:
        solve = kind == "solve"
        prompt, turns = ids(250 if solve else 1200), []
        for _ in range(4 if solve else 1):
            response = ids(100 if solve else 200)
            logp = [0.0] * len(response)  # set from the model by set_rollout_logp
            turns.append(Turn(prompt_ids=prompt, response_ids=response, response_logprobs=logp))
            prompt = prompt + response + ids(50)  # turns only append: one merged sequence
        advantage = rng.gauss(0, 1)
        return Episode(
            pack_id=pack,
            member=0,
            kind=kind,
            task_index=k,
            turns=turns,
            reward=0.0,
            advantage=advantage,
        )

    episodes, total, pack = [], 0, 0
    while True:
        for kind, k in order:
            ep = episode(pack, kind, k)
            total += len(ep.turns[-1].prompt_ids) + len(ep.turns[-1].response_ids)
            if total > shape.tokens:
                return episodes
            episodes.append(ep)
        pack += 1


def step_batch(shape: StepShape):
    """(micro-batches, denominator, stats) of the step, packed as the trainer packs."""
    from cod_fast.data.packing import pack_microbatches, rollout_sequences, step_totals
    from cod_fast.ops import aggregation_denominator

    seqs = rollout_sequences(cod_episodes(shape))
    lengths = [len(s) for s in seqs]
    budget = max(math.ceil(1.15 * sum(lengths) / shape.micro_batches), max(lengths))
    (mbs,) = pack_microbatches(seqs, budget, 1)
    trainable, segments = step_totals([mbs])
    stats = {"tokens": sum(lengths), "trainable": trainable, "sequences": len(seqs)}
    stats |= {"segments": segments, "micro_batches": len(mbs)}
    stats["attn_pairs"] = sum(n * n for n in lengths)
    return mbs, aggregation_denominator(LOSS, trainable, segments), stats


def build_model(shape: StepShape, device, dtype, grad_ckpt: bool = False, lean: bool = True):
    """A seeded Qwen3ForCausalLM from a config, prepared for training as the trainer prepares
    it: packed attention for `device`, the memory-lean MLPs and norms when `lean` (the
    trainer's default), gradient checkpointing per decoder layer when `grad_ckpt`."""
    import torch

    from cod_fast.config import ModelConfig
    from cod_fast.model.loading import prepare_model

    model = shape.seeded_model()
    cfg = ModelConfig(gradient_checkpointing=grad_ckpt, lean_activations=lean)
    prepare_model(model, cfg, torch.device(device))
    return model.to(device=device, dtype=dtype)


def set_rollout_logp(model, mbs, device) -> None:
    """Sampler log-probs near the initial policy's (0.1 nats of noise), as the trainer's
    recompute would see them: the REC mask drops a few tokens and keeps the rest."""
    import torch

    from cod_fast.model.policy import Policy

    g, policy = torch.Generator().manual_seed(SEED), Policy(model)
    with torch.no_grad():
        for mb in mbs:
            logp = policy(mb.to(device), loss_config=LOSS, mode="logprobs").float().cpu()
            mb.rollout_logp = logp + 0.1 * torch.randn(logp.shape, generator=g)


def logits_eager_step(model, optimizer, microbatches, *, denominator, loss_config, grad_clip):
    """`train_step` the plain way: full logits, log_softmax, gather, the loss on log-probs."""
    import torch

    from cod_fast.model.attention import packed_attention_kwargs
    from cod_fast.ops import LossInputs, policy_loss_from_logp

    model.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    total = 0.0
    for mb in microbatches:
        mb = mb.to(device)
        out = model(
            input_ids=mb.input_ids[None],
            position_ids=mb.position_ids[None],
            use_cache=False,
            **packed_attention_kwargs(mb.cu_seqlens, mb.max_seqlen),
        )
        # A float32 log_softmax, as RL libraries do for bf16 models; `del` so that no name
        # keeps a [T, V] tensor alive through the backward beyond what autograd saves.
        log_probs = torch.log_softmax(out.logits[0].float() / loss_config.temperature, dim=-1)
        del out
        inputs = LossInputs(
            mb.advantages,
            mb.segment_ids,
            old_logp=mb.old_logp,
            rollout_logp=mb.rollout_logp,
            denominator=denominator,
        )
        loss, _ = policy_loss_from_logp(
            log_probs[mb.trainable_idx, mb.targets], inputs, loss_config=loss_config
        )
        del log_probs
        loss.backward()
        total += float(loss.detach())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    optimizer.step()
    return total, norm


def make_step(contender: str, model, mbs, denominator: float, impl: str | None = None):
    """(step, optimizer): step() runs one optimizer step and returns (loss, grad norm); `impl`
    is the fused loss's implementation (None: the device's default)."""
    import torch

    from cod_fast.model.policy import Policy
    from cod_fast.train.step import train_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    kwargs = dict(denominator=denominator, loss_config=LOSS, grad_clip=GRAD_CLIP)
    if contender == "fused":
        policy = Policy(model, impl=impl)

        def step():
            result = train_step(policy, optimizer, mbs, **kwargs)
            return result.loss, result.grad_norm

        return step, optimizer
    return (lambda: logits_eager_step(model, optimizer, mbs, **kwargs)), optimizer
