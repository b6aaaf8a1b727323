"""The trainer's checkpoints: what a run saves after a step, and what it takes back on `--resume`.

A checkpoint at step N (cod_fast.run.checkpoint holds the format on disk) keeps everything N
completed steps produced: the model, the optimizer (the warm start's up to its last step, RL's
after), every rank's RNGs and sampler stream, and the batch source's state (the rollout workers'
sampler streams, a replay pool). Beside the checkpoints lies the KL term's reference, the policy
as RL began, written once when RL starts and read back by every resume after it.

Every rank calls every method here together, and a failure on any rank is raised on every
rank, so that no rank waits in a collective for one that stopped. Under torchrun with FSDP2 a
checkpoint is in rank shards (cod_fast.run.sharded): every rank writes its own rows of the model
and the optimizer into the checkpoint's folder, and on resume reads back the rows it holds now,
at any world size, so no rank ever holds a full state. In one process the states are whole, and
so is a checkpoint in rank shards read by one process (it gathers it); the other files are
written and read by the main rank alone, and what it read reaches the others by broadcast.
"""

from __future__ import annotations

import time
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
from cod_fast.distributed.fsdp import (
    check_model_shapes,
    load_model_shards,
    load_model_state,
    model_shards,
    model_state,
    shard_policy,
)
from cod_fast.distributed.optim_state import (
    check_optimizer_shapes,
    load_optimizer_shards,
    load_optimizer_state,
    optimizer_shards,
    optimizer_state,
)
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from cod_fast.rollout.sampler import Sampler
from cod_fast.run.checkpoint import (
    Checkpoint,
    CheckpointError,
    abandon_checkpoint,
    begin_checkpoint,
    finish_checkpoint,
    read_model_state,
    read_optimizer_state,
    read_rank_states,
    read_weights,
    restoring,
    save_checkpoint,
    write_failure,
)
from cod_fast.run.directory import RunDirError, check_resume, flat_config, tokenizer_fingerprint
from cod_fast.run.init_from import initial_weights
from cod_fast.run.log import RunLog
from cod_fast.run.sharded import INDEX, PLAIN, read_index, read_plain, read_rows, write_rank_files
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
    On the main rank, `on_saved(step, folder, seconds)` hears of each checkpoint written and
    `on_restored(step, folder)` of the one a resumed run took back (a progress display's lines).
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
        self.shards = ctx.sharded and ctx.distributed and cfg.runtime.checkpoint_format == "auto"
        """Whether a save writes rank shards (runtime.checkpoint_format); a load reads what
        the checkpoint holds, either format."""
        self.on_saved: Callable[[int, Path, float], None] | None = None
        self.on_restored: Callable[[int, Path], None] | None = None

    def save(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Checkpoint `step`: model, optimizer, every rank's RNGs and sampler, the batch source;
        in rank shards under torchrun with FSDP2, whole in one process."""
        started = time.perf_counter()
        rank_state = {
            "rng": rng_state(),
            "sampler": self.sampler.state_dict(),
            "batch_source": self.batches.state(),  # the rollout workers' sampler states
        }
        ranks = gather_objects(rank_state, self.ctx)
        extra = {
            "warm_start_steps": self.warm_steps,
            "world_size": self.ctx.world_size,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "master_dtype": str(self.master_dtype).removeprefix("torch."),
            "config": flat_config(self.cfg),
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
        }
        if self.shards:
            folder = self._save_shards(step, optimizer, ranks, extra)
            self._saved(step, folder, started)
            return
        weights = model_state(self.policy, self.ctx)
        optim = optimizer_state(self.policy, optimizer, self.ctx)
        failure = folder = None
        if self.ctx.is_main:
            try:
                keep = self.cfg.runtime.keep_checkpoints
                folder = save_checkpoint(
                    self.run_dir, step, weights, optim, rank_states=ranks, extra=extra, keep=keep
                )
            except CheckpointError as exc:
                failure = exc
        # Every rank learns whether the save failed (this also waits for it), so all stop alike.
        if all_reduce_max(int(failure is not None), self.ctx):
            raise failure or CheckpointError("the main process could not write the checkpoint")
        self._saved(step, folder, started)

    def _saved(self, step: int, folder: Any, started: float) -> None:
        """Tell `on_saved` on the main rank, where `folder` is the folder of checkpoint `step`,
        how long its save took since `started` (perf_counter())."""
        if self.ctx.is_main and self.on_saved is not None:
            self.on_saved(step, folder, time.perf_counter() - started)

    def _save_shards(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        ranks: list[dict[str, Any]],
        extra: dict[str, Any],
    ) -> Path | dict:
        """Checkpoint `step` in rank shards: the main rank makes the temporary folder, every
        rank writes its own rows into it (its own shard of host memory, a tensor at a time),
        and once all have (the gather is the barrier) the main rank completes it. A failure on
        any rank raises CheckpointError on every rank, the checkpoints already there intact.
        Returns the checkpoint's folder on the main rank ({} on the others)."""
        ctx = self.ctx
        tmp = broadcast_object(
            self._read_on_main(lambda: begin_checkpoint(self.run_dir, step)), ctx
        )
        plain, slots = optimizer_shards(self.policy, optimizer, ctx)
        report = failure = None
        try:
            report = write_rank_files(tmp, ctx.rank, model_shards(self.policy, ctx), slots)
        except Exception as exc:  # it must reach every rank, or they wait for this one
            failure = exc
        said = None if failure is None else _rank_failure(self.run_dir, step, ctx.rank, failure)
        reports = gather_objects((report, said), ctx)
        problem = next((line for _, line in reports if line is not None), None)

        def finish() -> Path:
            if problem is not None:
                abandon_checkpoint(tmp)
                raise CheckpointError(problem)
            written = [r for r, _ in reports if r is not None]
            keep = self.cfg.runtime.keep_checkpoints
            shards = (written, ctx.world_size, plain)
            return finish_checkpoint(
                self.run_dir, step, tmp, rank_states=ranks, extra=extra, keep=keep, shards=shards
            )

        try:
            return self._read_on_main(finish)
        except CheckpointError as exc:
            raise exc from failure  # on the rank that failed, with its traceback

    def restore_or_start(self, resume: bool, optimizer: torch.optim.Optimizer) -> Restored:
        """The latest checkpoint taken back (`resume`, and one exists), else a new run at step 0
        with `optimizer` and `train.init_from`'s weights where the config names them."""
        ckpt = check_resume(self.cfg, resume)
        if ckpt is not None:
            restored = self._restore(ckpt, optimizer)
            if self.ctx.is_main and self.on_restored is not None:
                self.on_restored(ckpt.step, ckpt.path)
            return restored
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
        # The optimizer that wrote the checkpoint: the warm start's up to its last step (RL then
        # starts a fresh one), RL's after.
        if step > self.warm_steps and self.warm_steps:
            optimizer = self.new_optimizer(False)
        if ckpt.sharded and self.ctx.sharded:
            self._load_shards(ckpt, optimizer)
        else:
            self._load_whole(ckpt, optimizer)
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

    def _load_whole(self, ckpt: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
        """The model and the optimizer from full states the main rank reads (gathered whole
        from a checkpoint in rank shards) and sends to the others."""
        # A state that does not fit what takes it back (a damaged or edited file) is a
        # ValueError there, and one line naming the file here (`restoring`).
        state = self._read_on_main(lambda: read_model_state(ckpt))
        with restoring(ckpt, ckpt.model_file):
            load_model_state(self.policy, state, self.ctx)
        state = self._read_on_main(lambda: read_optimizer_state(ckpt))
        with restoring(ckpt, PLAIN if ckpt.sharded else "optimizer.pt"):
            load_optimizer_state(self.policy, optimizer, state, self.ctx)

    def _load_shards(self, ckpt: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
        """The model and the optimizer from a checkpoint in rank shards, at any world size:
        the main rank reads the index and the optimizer's plain part and sends them to the
        others, then every rank reads the rows it holds now, and only those, from the files
        (cod_fast.run.sharded.read_rows). Each rank decides alike whether the index fits the
        model and the optimizer, so none waits for another that refused it."""
        ctx, path = self.ctx, ckpt.path

        def read_small() -> tuple[Any, Any]:
            with restoring(ckpt, INDEX):
                return read_index(path / INDEX, ckpt.sizes), read_plain(path / PLAIN)

        index, plain = broadcast_object(self._read_on_main(read_small), ctx)
        mine = {name: (s.start, s.stop) for name, s in model_shards(self.policy, ctx).items()}
        with restoring(ckpt, INDEX):
            check_model_shapes(self.policy, {k: e.shape for k, e in index.model.items()})
        with restoring(ckpt, PLAIN):
            slots = {k: (e.shape, e.dtype) for k, e in index.optim.items()}
            check_optimizer_shapes(self.policy, optimizer, plain, slots)
        rows = self._read_everywhere(ckpt, lambda: read_rows(path, index.model, "model", mine))
        load_model_shards(self.policy, rows, ctx)
        wanted = {key: mine[key[0]] for key in index.optim}  # a slot's rows are its parameter's
        rows = self._read_everywhere(ckpt, lambda: read_rows(path, index.optim, "optim", wanted))
        load_optimizer_shards(self.policy, optimizer, plain, rows, ctx)

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
        model, _ = load_policy(  # frozen: no master weights; in host memory until sharded
            cfg.model,
            self.ctx.device,
            cfg.train.seed,
            self.tokenizer,
            dtype=self.compute_dtype,
            place="cpu" if self.ctx.distributed else None,
        )
        reference = Policy(model, self.policy.impl, self.policy.sequence_group)
        reference = shard_policy(reference, self.ctx, frozen=True)  # one process: unsharded
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

    def _read_everywhere(self, ckpt: Checkpoint, read: Callable[[], Any]) -> Any:
        """`read()` of checkpoint `ckpt`'s files on every rank; a damaged file on any rank
        raises its CheckpointError on every rank, so none goes on without the others."""
        value, problem = None, None
        try:
            with restoring(ckpt, INDEX):
                value = read()
        except CheckpointError as exc:
            problem = str(exc)
        said = next((p for p in gather_objects(problem, self.ctx) if p is not None), None)
        if said is not None:
            raise CheckpointError(said)
        return value


def _rank_failure(run_dir: Path, step: int, rank: int, exc: BaseException) -> str:
    """The line that says rank `rank` could not write its files of checkpoint `step`."""
    root = run_dir / "checkpoints"
    if isinstance(exc, FileNotFoundError):  # the folder rank 0 made is not where it looked
        return (
            f"rank {rank} finds no temporary folder in {root} to write the checkpoint of step "
            f"{step} into: a run of several nodes checkpoints into a runtime.run_dir that every "
            "node shares (a shared file system)"
        )
    return f"rank {rank}: {write_failure(root, step, exc)}"
