"""The trainer's checkpoints: what a run saves after a step, and what it takes back on `--resume`.

A checkpoint at step N (cod_fast.run.checkpoint holds the format on disk) keeps everything N
completed steps produced: the model, the optimizer (the warm start's up to its last step, RL's
after), every rank's RNGs and sampler stream, and the batch source's state (the rollout workers'
sampler streams, a replay pool). Beside the checkpoints lies the KL term's reference, the policy
as RL began, written once when RL starts and read back by every resume after it.

Every rank calls every method here together: the states are gathered to the main rank, which
alone writes and reads files; what it read reaches the other ranks by broadcast, and a failure
on it is raised on every rank, so that no rank waits in a collective for one that stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cod_fast.common.rng import rng_state, set_rng_state
from cod_fast.common.safe_write import atomic_file
from cod_fast.config import Config
from cod_fast.distributed.context import (
    DistContext,
    all_reduce_max,
    broadcast_object,
    gather_objects,
)
from cod_fast.distributed.fsdp import load_model_state, model_state, shard_policy
from cod_fast.distributed.optim_state import load_optimizer_state, optimizer_state
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from cod_fast.rollout.sampler import Sampler
from cod_fast.run.checkpoint import (
    Checkpoint,
    CheckpointError,
    read_model_state,
    read_optimizer_state,
    read_rank_states,
    read_weights,
    restoring,
    save_checkpoint,
)
from cod_fast.run.directory import RunDirError, check_resume, flat_config, tokenizer_fingerprint
from cod_fast.run.init_from import initial_weights
from cod_fast.run.log import RunLog
from cod_fast.train.batches import BatchSource

REFERENCE = "reference.safetensors"
"""The KL reference's weights in the run directory."""


@dataclass
class Restored:
    """Where a run starts: its step, the optimizer that goes on, the KL reference (or None)."""

    step: int
    optimizer: torch.optim.Optimizer
    reference: Policy | None


class Checkpointer:
    """Saves a run's state after a step and restores it on resume, for one rank of the run.

    Contract: `save(step, optimizer)` writes checkpoint `step` of everything the run holds, or
    raises CheckpointError on every rank (the previous checkpoint stays intact);
    `restore_or_start(resume, optimizer)` loads the latest checkpoint into the policy, the
    sampler, the batch source and the RNGs, cuts the run log back to it and returns where the
    run goes on, or for a new run loads `train.init_from`'s weights and clears the log; a
    checkpoint that does not fit the run is a RunDirError or CheckpointError of one line, on
    every rank, before anything trains. `freeze_reference()` fixes the KL reference as RL starts.
    """

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        *,
        policy: Policy,
        sampler: Sampler,
        batches: BatchSource,
        log: RunLog,
        tokenizer: Any,
        dtypes: tuple[torch.dtype, torch.dtype],
        new_optimizer: Callable[[bool], torch.optim.Optimizer],
    ):
        """`dtypes`: the compute and master dtypes; `new_optimizer(warm)`: a fresh optimizer of
        the warm start (True) or RL (False) over `policy`."""
        self.cfg, self.ctx = cfg, ctx
        self.policy, self.sampler, self.batches, self.log = policy, sampler, batches, log
        self.tokenizer = tokenizer
        self.compute_dtype, self.master_dtype = dtypes
        self.new_optimizer = new_optimizer
        self.run_dir = Path(cfg.runtime.run_dir)
        self.warm_steps = cfg.train.warm_start_steps

    def save(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Checkpoint `step`: model, optimizer, every rank's RNGs and sampler, the batch source."""
        rank_state = {
            "rng": rng_state(),
            "sampler": self.sampler.state_dict(),
            "batch_source": self.batches.state(),  # the rollout workers' sampler states
        }
        ranks = gather_objects(rank_state, self.ctx)
        weights = model_state(self.policy, self.ctx)
        optim = optimizer_state(self.policy, optimizer, self.ctx)
        failure = None
        if self.ctx.is_main:
            try:
                save_checkpoint(
                    self.run_dir,
                    step,
                    weights,
                    optim,
                    rank_states=ranks,
                    extra={
                        "warm_start_steps": self.warm_steps,
                        "world_size": self.ctx.world_size,
                        "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                        "master_dtype": str(self.master_dtype).removeprefix("torch."),
                        "config": flat_config(self.cfg),
                        "tokenizer": tokenizer_fingerprint(self.tokenizer),
                    },
                    keep=self.cfg.runtime.keep_checkpoints,
                )
            except CheckpointError as exc:
                failure = exc
        # Every rank learns whether the save failed (this also waits for it), so all stop alike.
        if all_reduce_max(int(failure is not None), self.ctx):
            raise failure or CheckpointError("the main process could not write the checkpoint")

    def restore_or_start(self, resume: bool, optimizer: torch.optim.Optimizer) -> Restored:
        """The latest checkpoint taken back (`resume`, and one exists), else a new run at step 0
        with `optimizer` and `train.init_from`'s weights where the config names them."""
        ckpt = check_resume(self.cfg, resume)
        if ckpt is not None:
            return self._restore(ckpt, optimizer)
        if self.cfg.train.init_from is not None:
            weights = self._read_on_main(lambda: initial_weights(self.cfg.train.init_from))
            load_model_state(self.policy, weights, self.ctx)
        self.log.truncate(-1)
        return Restored(0, optimizer, None)

    def freeze_reference(self) -> Policy | None:
        """The KL term's reference as RL starts: the policy as it is now, also written to the
        run directory (so a resumed run gets it back); None without a KL term."""
        return self._reference(model_state(self.policy, self.ctx), save=True)

    def _restore(self, ckpt: Checkpoint, optimizer: torch.optim.Optimizer) -> Restored:
        recorded = ckpt.extra.get("tokenizer")
        if recorded is not None and recorded != tokenizer_fingerprint(self.tokenizer):
            raise RunDirError(
                f"the checkpoint of step {ckpt.step} in {self.run_dir} was trained with another "
                "tokenizer than this run loads (its token ids would mean other text): restore "
                f"the run's tokenizer ({self.run_dir / 'tokenizer'} for a built-in model, else "
                "the model folder's), or start a new run_dir"
            )
        step, reference = ckpt.step, None
        # A state that does not fit what takes it back (a damaged or edited file) is a
        # ValueError there, and one line naming the file here (`restoring`).
        state = self._read_on_main(lambda: read_model_state(ckpt))
        with restoring(ckpt, "model.safetensors"):
            load_model_state(self.policy, state, self.ctx)
        # The optimizer that wrote the checkpoint: the warm start's up to its last step (RL then
        # starts a fresh one), RL's after.
        if step > self.warm_steps and self.warm_steps:
            optimizer = self.new_optimizer(False)
        state = self._read_on_main(lambda: read_optimizer_state(ckpt))
        with restoring(ckpt, "optimizer.pt"):
            load_optimizer_state(self.policy, optimizer, state, self.ctx)
        if step > self.warm_steps:
            path = self.run_dir / REFERENCE
            fix = "it is the KL reference (the policy as RL began): restore it from a backup"
            state = self._read_on_main(lambda: read_weights(path, fix) if path.exists() else {})
            reference = self._reference(state, save=False)
        ranks = read_rank_states(ckpt)
        with restoring(ckpt, "ranks.pt"):
            self.batches.load_state(ranks[0].get("batch_source"))
            if len(ranks) == self.ctx.world_size:  # else new streams: resumed, not bit-for-bit
                mine = ranks[self.ctx.rank]
                set_rng_state(mine.get("rng"))
                self.sampler.load_state_dict(mine.get("sampler"))
        self.log.truncate(step)
        return Restored(step, optimizer, reference)

    def _reference(self, state: dict[str, torch.Tensor], save: bool) -> Policy | None:
        """The KL term's reference holding `state` (kept in the run directory with `save`);
        nothing at all without a KL term."""
        loss = self.cfg.algo.loss
        if loss.kl is None or loss.beta == 0:
            return None
        if save and self.ctx.is_main:  # renamed into place: a link there is replaced, not followed
            with atomic_file(self.run_dir / REFERENCE) as tmp:
                save_file(state, tmp)
        cfg = self.cfg
        model, _ = load_policy(  # frozen: no master weights
            cfg.model, self.ctx.device, cfg.train.seed, self.tokenizer, dtype=self.compute_dtype
        )
        reference = Policy(model, self.policy.impl)
        reference = shard_policy(reference, self.ctx) if self.ctx.distributed else reference
        load_model_state(reference, state, self.ctx)
        reference.eval().requires_grad_(False)
        return reference

    def _read_on_main(self, read: Callable[[], Any]) -> Any:
        """`read()` on the main rank ({} on the others, which get the state by broadcast); a
        damaged file there raises its CheckpointError on every rank, so none waits for it."""
        value, problem = {}, None
        if self.ctx.is_main:
            try:
                value = read()
            except CheckpointError as exc:
                problem = str(exc)
        if (problem := broadcast_object(problem, self.ctx)) is not None:
            raise CheckpointError(problem)
        return value
