"""Teachers of on-policy distillation (`algo.teachers`, `algo.loss.policy=opd`).

The loss they feed is docs/concepts.md section 4's `opd`.

Each environment of the run has one teacher: a causal LM folder (`cod-fast export` of a run, or
any Hugging Face folder) that shares the student's tokenizer. Every RL step, the teacher of each
sequence's environment scores the student's own packed sequences: one teacher forward over each
sequence, its hidden states at the trainable positions only through the fused `linear_logprobs`
(cod_fast.model.policy in `logprobs` mode, so no teacher logits are materialised), under no_grad. The
log-probs ride on the segments into the micro-batches, where the opd loss reads them as teach_t.

Teachers stay on the training device when they all fit next to the student (always on the
CPU); otherwise they wait in host memory and each is moved to the device for its own sequences
in turn, then back. Under torchrun every rank holds whole teachers and scores its own sequences.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import torch

from cod_fast.config import ConfigError, LossConfig, ModelConfig
from cod_fast.data.packing import Sequence, build_microbatch, plan_microbatches
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy

DEVICE_SHARE = 0.5
"""Teachers stay on a GPU when their weights take at most this share of its free memory (the
rest is the student's activations and optimizer step)."""


def check_tokenizer(student, teacher, where: str) -> None:
    """Refuse a teacher whose vocabulary differs from the student's: its log-probs would score
    other tokens than the ones the student sampled."""
    if student.get_vocab() != teacher.get_vocab() or student.eos_token != teacher.eos_token:
        raise ConfigError(
            where,
            f"the teacher's tokenizer ({len(teacher)} tokens, eos {teacher.eos_token!r}) is not "
            f"the student's ({len(student)} tokens, eos {student.eos_token!r}); teacher and "
            "student must share one (for built-in models: train the teacher with "
            "model.tokenizer_path set to the student's tokenizer folder)",
        )


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` of teacher weights may stay on `device` for the whole run."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= DEVICE_SHARE * free


class Teachers:
    """One frozen teacher Policy per environment."""

    def __init__(
        self,
        paths: dict[str, str],
        model: ModelConfig,
        device: torch.device,
        student_tokenizer,
        impl: str | None = None,
    ):
        self.device = device
        self.models: dict[str, Policy] = {}
        for env, path in paths.items():
            cfg = dataclasses.replace(model, name_or_path=path, gradient_checkpointing=False)
            # Loaded into host memory, but in the dtype and with the attention kernel of the
            # device it computes on, whether it then stays there or moves there in turn.
            teacher, tokenizer = load_policy(cfg, device, place="cpu")
            check_tokenizer(student_tokenizer, tokenizer, f"algo.teachers.{env}")
            self.models[env] = Policy(teacher, impl).eval().requires_grad_(False)
        nbytes = sum(
            p.numel() * p.element_size() for t in self.models.values() for p in t.parameters()
        )
        self.resident = fits_on_device(nbytes, device)
        if self.resident:
            for teacher in self.models.values():
                teacher.to(device)

    @torch.no_grad()
    def score(
        self,
        sequences: list[Sequence],
        loss: LossConfig,
        token_budget: int,
        share_prefix: bool = False,
    ) -> dict:
        """Set `teacher_logp` on every segment of `sequences` (each by its sequence's
        environment); returns the teacher metrics: per environment the mean log-prob gap
        teach - roll over its trainable tokens (roll is the sampler's log-prob, the student's
        own at sampling), and the seconds spent."""
        started = time.perf_counter()
        by_env: dict[str, list[Sequence]] = defaultdict(list)
        for seq in sequences:
            by_env[seq.env].append(seq)
        metrics: dict[str, float] = {}
        gaps: list[float] = []
        for env, group in sorted(by_env.items()):
            if env not in self.models:
                raise ValueError(f"a sequence of environment {env!r} has no teacher")
            gap = self._score_env(self.models[env], group, loss, token_budget, share_prefix)
            metrics[f"teacher_gap/{env}"] = sum(gap) / len(gap) if gap else 0.0
            gaps += gap
        if gaps:
            metrics["teacher_gap"] = sum(gaps) / len(gaps)
        metrics["teacher_s"] = time.perf_counter() - started
        return metrics

    def _score_env(
        self,
        teacher: Policy,
        group: list[Sequence],
        loss: LossConfig,
        token_budget: int,
        share_prefix: bool,
    ) -> list[float]:
        if not self.resident:
            teacher.to(self.device)
        gap: list[float] = []
        # One forward per token: the environment's sequences packed into budget-sized batches
        # (per distinct token, with shared prefixes packed once).
        for indices in plan_microbatches(group, token_budget, 1, share_prefix)[0]:
            chosen = [group[i] for i in indices]
            mb = build_microbatch(chosen, share_prefix).to(self.device)
            logp = teacher(mb, loss_config=loss, mode="logprobs").float().cpu()
            offset = 0
            for seq in chosen:
                for seg in seq.segments:
                    seg.teacher_logp = logp[offset : offset + seg.length].tolist()
                    offset += seg.length
                    gap += [t - r for t, r in zip(seg.teacher_logp, seg.rollout_logp, strict=True)]
        if not self.resident:
            teacher.to("cpu")
        return gap
