"""One writer per run directory, and what `--resume` may continue.

A run directory has one writer at a time: the process that trains it holds an exclusive
`fcntl.flock` on `RUN_DIR/.lock` from before its first write (the preflight's tokenizer) to its
end. The kernel drops the lock when the process dies, SIGKILL included, so a crash never leaves
a stale lock; a second `cod-fast train` (or `--resume`) on the same folder is refused at once
with the holder's pid. The lock is reentrant within a process (the CLI and the Trainer it builds
both take it), since flock would otherwise refuse a second descriptor of the same process.
A run directory may come from someone else, so taking the lock also refuses one that holds a
symbolic link (the folder itself may be one): nothing of a run is written through a link.

`--resume` continues exactly one run, or refuses:
- nothing to continue (no folder, or no `config.yaml` of a run): refused, rather than starting a
  fresh run that the user believes is a continuation;
- checkpoint folders but no `checkpoints/latest`: refused, naming the newest complete folder
  and how to point `latest` at it (starting over would overwrite them);
- a run that logged steps but never checkpointed: refused (its metrics would be emptied);
- a config that differs from the checkpoint's in anything but how the run executes
  (`RESUMABLE`): refused, naming every changed field with both values; so is a tokenizer that
  is not the one the checkpoint was trained with (`tokenizer_fingerprint`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cod_fast.common.errors import CodFastError
from cod_fast.common.safe_write import LinkError, check_entries, open_fd
from cod_fast.config import DERIVED, Config, shown
from cod_fast.config.io import load_run_config
from cod_fast.run.checkpoint import LATEST, Checkpoint, complete_checkpoints, latest_checkpoint
from cod_fast.run.log import read_log

LOCK = ".lock"

RESUMABLE = (
    "runtime.",
    "train.steps",
    "train.max_skipped_steps",
    "train.token_budget",
    "train.share_prefix",
    "train.init_from",
    "rollout.sampler",
    "rollout.vllm_gpu_memory_utilization",
    "rollout.vllm_eager",
    "rollout.torch_fast_decode",
    "rollout.torch_static_shapes",
    "rollout.torch_cuda_graphs",
    "model.attn_impl",
    "model.gradient_checkpointing",
    "model.lean_activations",
)
"""Config fields (a trailing dot: every field of that section) a resumed run may change: how
the run executes, how long it goes on, and where it writes, never what it computes. Packing
(token budget, shared prefixes) and the attention kernel change rounding only; `init_from`
matters at step 0 alone."""


class RunDirError(RuntimeError, CodFastError):
    """The run directory does not fit the request (another writer, checkpoints present without
    --resume, nothing to resume, a resume with other settings)."""


_held: dict[Path, list[int]] = {}
"""Run directories this process has locked: path -> [descriptor, holds]."""


def lock_run_dir(run_dir: str | Path) -> None:
    """Take the run directory's lock (creating the folder), or raise RunDirError naming the
    process that holds it, or an entry of the folder that is a symbolic link (nothing is
    written through one: cod_fast.common.safe_write), before anything is written there. Reentrant:
    every call needs its `unlock_run_dir`."""
    path = Path(run_dir).resolve()
    if path in _held:
        _held[path][1] += 1
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        check_entries(run_dir)
        # No O_TRUNC: the holder's pid stays readable until this process holds the lock.
        fd = open_fd(Path(run_dir) / LOCK, os.O_RDWR | os.O_CREAT)
    except LinkError as e:
        raise RunDirError(str(e)) from None
    except OSError as e:  # a read-only or foreign folder
        raise RunDirError(
            f"cannot create the run directory {run_dir} or its lock file: {e.strerror}; set "
            "runtime.run_dir to a folder you can write"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is being written by another cod-fast process (pid {holder}); wait for "
            "it to end, or set runtime.run_dir to another folder"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[path] = [fd, 1]


def unlock_run_dir(run_dir: str | Path) -> None:
    """Give back one hold of the lock; the last one releases it."""
    path = Path(run_dir).resolve()
    entry = _held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[path]
        os.close(entry[0])  # closing the descriptor releases the flock


def flat_config(cfg: Config) -> dict[str, Any]:
    """A config as {dotted field: value}, each value as JSON gives it back (what a checkpoint's
    meta.json stores); nested sections flatten (`algo.loss.policy`), lists and mappings stay
    values (`rollout.envs`, `algo.teachers`)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):  # a nested section (algo.loss)
                walk(f"{prefix}{f.name}.", value)
            else:
                out[prefix + f.name] = json.loads(json.dumps(value, default=dataclasses.asdict))

    walk("", cfg)
    return out


def config_changes(saved: dict[str, Any], cfg: Config) -> list[str]:
    """`field: old -> new` for every field outside RESUMABLE where `cfg` differs from the
    config a checkpoint was written with (`saved`, its flat_config)."""
    # Checkpoints written before a rollout key replaced a loss key (DERIVED) have only the
    # loss's; its value is the one the rollout key now holds. A key added since the checkpoint
    # was written has its default there: a new key's default keeps the behaviour before it.
    old = {**flat_config(Config()), **{n: saved[o] for o, n in DERIVED.items() if o in saved}}
    old.update(saved)
    new = flat_config(cfg)
    changed = []
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(RESUMABLE) or old.get(key) == new.get(key):
            continue
        changed.append(f"{key}: {shown(old.get(key))} -> {shown(new.get(key))}")
    return changed


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what the run's token ids mean: the vocabulary and the EOS token."""
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in read_log(path).splitlines() if line.strip())


def check_resume(cfg: Config, resume: bool) -> Checkpoint | None:
    """The checkpoint the run in cfg.runtime.run_dir continues from (None: it starts at step
    0), or RunDirError for a folder that does not fit `resume` (module docstring)."""
    run = Path(cfg.runtime.run_dir)
    ckpt = latest_checkpoint(run)
    folders = complete_checkpoints(run)
    if not resume:
        if ckpt is not None or folders:
            newest = f"step {ckpt.step}" if ckpt is not None else folders[-1]
            raise RunDirError(
                f"{run} already has checkpoints (latest: {newest}); pass --resume to continue "
                "that run, or set runtime.run_dir to a new folder"
            )
        if (run / "metrics.jsonl").exists():
            raise RunDirError(
                f"{run} already holds a run's metrics.jsonl; pass --resume to continue it, or "
                "set runtime.run_dir to a new folder"
            )
        return None
    if ckpt is None:
        if folders:
            latest = run / "checkpoints" / LATEST
            raise RunDirError(
                f"{latest} is missing, so --resume cannot tell which checkpoint to continue; the "
                f"newest complete one is {folders[-1]}: write its name into that file (echo "
                f"{folders[-1]} > {latest}), then --resume"
            )
        if not (run / "config.yaml").is_file():
            raise RunDirError(
                f"--resume, but {run} holds no run (no config.yaml); drop --resume to start one "
                "there, or set runtime.run_dir to the run you meant"
            )
        if logged := _logged_steps(run):
            raise RunDirError(
                f"--resume, but the run in {run} logged {logged} steps without writing a "
                "checkpoint (runtime.checkpoint_every), so there is nothing to continue from; "
                "start it again in a new runtime.run_dir (or delete this one)"
            )
        return None
    saved = ckpt.extra.get("config") or flat_config(load_run_config(run / "config.yaml"))
    if changes := config_changes(saved, cfg):
        raise RunDirError(
            f"--resume with settings the checkpoint of step {ckpt.step} was not trained with: "
            f"{'; '.join(changes)}; resume with the run's own config ({run / 'config.yaml'}), "
            "changing only how it runs (runtime.*, train.steps, the sampler and kernels), or "
            "start a new run_dir (train.init_from takes this run's weights)"
        )
    return ckpt
