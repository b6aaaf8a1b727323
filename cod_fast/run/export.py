"""`cod-fast export`: a run's checkpoint as a Hugging Face model folder.

The folder (config, safetensors weights, tokenizer) loads with `from_pretrained` anywhere,
vLLM and `cod-fast eval` included. The model is rebuilt from the run's own config.yaml (the
built-in model from its sizes and the run's tokenizer), then given the checkpoint's weights
(those of a run under torchrun gathered whole from its rank shards, in this one process), and
saved with the standard SDPA attention, so nothing of cod-fast is needed to load it. The weights
are written in the dtype asked for; by default the run's compute dtype (a mixed-precision run
keeps float32 masters in its checkpoints and computed in bf16: the export is bf16). Beside it
lies the run's resolved config (RUN_CONFIG): `cod-fast eval --model DIR` reads it and evaluates
with the run's own packs, settings and sampling noise.

The folder appears whole or not at all: it is written beside its place and renamed into it, so
a kill leaves the previous export (or none), never a model without its tokenizer, and nothing
of a previous export (a stale shard index) survives it. Only an empty folder or a previous
export is replaced; any other folder is refused, so no file of the user's is deleted.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError

from cod_fast.common.errors import CodFastError
from cod_fast.common.safe_write import LinkError, fresh_folder, remove
from cod_fast.common.values import write_cause
from cod_fast.config import Config, ConfigError, shown
from cod_fast.config.io import dump_yaml, load_run_config
from cod_fast.distributed.context import DistContext
from cod_fast.distributed.fsdp import load_model_state
from cod_fast.model.loading import BUILTIN_TINY, load_policy, resolve_dtype
from cod_fast.model.policy import Policy
from cod_fast.model.tokenizer import load_saved_tokenizer
from cod_fast.rollout.chat import names_file, read_template
from cod_fast.run.checkpoint import (
    Checkpoint,
    checkpoint_at,
    complete_checkpoints,
    latest_checkpoint,
    read_model_state,
    restoring,
)
from cod_fast.run.directory import config_changes
from cod_fast.run.log import TEMPLATE

RUN_CONFIG = "cod_fast_run.yaml"
"""The run's resolved config, in an exported model folder."""


class ExportError(OSError, CodFastError):
    """An export that could not be written (a full disk, a read-only folder): one line naming
    `--out`, the cause and the free space; a previous export there is left as it was."""


def read_run_config(folder: str | Path) -> Config | None:
    """The config of the run a model folder was exported from, or None for any other model."""
    path = Path(folder) / RUN_CONFIG
    return load_run_config(path) if path.exists() else None


def _checkpoint(run_dir: Path, step: int | None) -> Checkpoint:
    # A given step is found without `latest`, so that an older checkpoint still exports when
    # the newest one is damaged.
    if step is not None:
        ckpt = checkpoint_at(run_dir, step)
        if ckpt is None:
            kept = complete_checkpoints(run_dir)
            raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step}; it keeps {kept}")
        return ckpt
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint (checkpoints/latest); export a run directory that "
            "`cod-fast train` wrote, after its first checkpoint"
        )
    return latest


def _check_model_settings(config: Path, cfg: Config, ckpt: Checkpoint) -> None:
    """Refuse a config.yaml whose model is not the one the checkpoint recorded it was trained
    with (a damaged or edited file): it would build another model, or name one to download."""
    saved = ckpt.extra.get("config")
    changes = [c for c in config_changes(saved, cfg) if c.startswith("model.")] if saved else []
    if changes:
        key, change = changes[0].split(": ", 1)
        raise ConfigError(
            key,
            f"{change}: {config} does not hold the model the checkpoint of step {ckpt.step} "
            "was trained with; restore the run's config.yaml (the checkpoint's meta.json "
            "records its settings)",
        )


def _run_template(run_dir: Path, cfg: Config) -> str | None:
    """The text of the run's `model.chat_template`, from the copy the run keeps (TEMPLATE), or
    None when it has none. The file the config names is never read: the run directory may come
    from anyone, and that name could point at any file of this machine (whose text would then
    leave with the export)."""
    if cfg.model.chat_template is None:
        return None
    if not names_file(cfg.model.chat_template) and "{" in cfg.model.chat_template:
        return cfg.model.chat_template  # the template itself, written in the config
    kept = run_dir / TEMPLATE
    if kept.is_symlink() or not kept.is_file():
        what = "a symbolic link" if kept.is_symlink() else "missing"
        raise ConfigError(
            "model.chat_template",
            f"{kept} is {what}: the run names the template file "
            f"{shown(cfg.model.chat_template)}, and export reads only the run's own copy of it; "
            f"copy the template the run was trained with to {kept}",
        )
    return read_template(str(kept))


def _check_destination(out: Path) -> None:
    """Refuse an `out` whose replacement would delete files that are not a previous export."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(
            f"{out} is a file, not a folder to export into; name a new or empty folder"
        )
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and RUN_CONFIG not in held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise FileExistsError(
            f"{out} holds files that `cod-fast export` did not write ({shown}; no {RUN_CONFIG}), "
            "which an export would delete as it replaces the folder; name a new or empty folder"
        )


@contextmanager
def replacing(out: Path) -> Iterator[Path]:
    """A new folder to write into; once the block ends, it takes the place of `out`.

    It lies beside `out` (one file system, so renames are atomic): `out` moves aside, the new
    folder moves in, the old one is removed. At every moment `out` is the previous export (or
    the empty folder), the new one, or absent (a kill between the renames). A failed write
    removes its folder; a killed one's leftovers are removed by the next export to `out`. A
    link where the new folder goes is refused, so nothing is written through it
    (cod_fast.common.safe_write)."""
    place = out.absolute()  # `--out .` has a name to put beside
    tmp = place.with_name(f".{place.name}.export-tmp")
    old = place.with_name(f".{place.name}.export-old")
    fresh_folder(tmp)
    remove(old)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(place):
        place.rename(old)
    tmp.rename(place)
    shutil.rmtree(old, ignore_errors=True)


ExportDtype = Literal["auto", "float32", "bfloat16", "float16"]


def export_dtype(ckpt: Checkpoint, cfg: Config, dtype: ExportDtype) -> torch.dtype:
    """The dtype to write: as asked, or (`auto`) the compute dtype the checkpoint was trained
    in, else (a checkpoint that does not record it) the run's model.dtype on the CPU."""
    if dtype != "auto":
        return getattr(torch, dtype)
    recorded = ckpt.extra.get("compute_dtype")
    return getattr(torch, recorded) if recorded else resolve_dtype(cfg.model, torch.device("cpu"))


def export_model(
    run_dir: str | Path, out: str | Path, step: int | None = None, dtype: ExportDtype = "auto"
) -> Checkpoint:
    """Write checkpoint `step` (default: the latest) of `run_dir` to `out` in `dtype` (see
    `export_dtype`), replacing a previous export there as a whole; returns the checkpoint.
    Bad input (no checkpoint, a damaged one, an `out` holding other files) is refused before
    the model is built."""
    run_dir, out = Path(run_dir), Path(out)
    config = run_dir / "config.yaml"
    if not config.exists():
        raise FileNotFoundError(f"{run_dir} has no config.yaml; is it a cod-fast run directory?")
    cfg = load_run_config(config)
    ckpt = _checkpoint(run_dir, step)
    _check_model_settings(config, cfg, ckpt)
    template = _run_template(run_dir, cfg)
    _check_destination(out)
    weights = read_model_state(ckpt)
    tokenizer = None
    if cfg.model.name_or_path == BUILTIN_TINY and (run_dir / "tokenizer").exists():
        tokenizer = load_saved_tokenizer(run_dir / "tokenizer")
    model, tokenizer = load_policy(
        cfg.model, "cpu", cfg.train.seed, tokenizer, dtype=export_dtype(ckpt, cfg, dtype)
    )
    one_process = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None
    )
    with restoring(ckpt, ckpt.model_file):  # weights that do not fit: one line naming them
        load_model_state(Policy(model), weights, one_process)
    model.set_attn_implementation("sdpa")
    if template is not None:
        # The run's template goes into the exported tokenizer, so the folder renders prompts as
        # the run did wherever it is loaded (the template's file need not travel with it).
        tokenizer.chat_template = template
        cfg = replace(cfg, model=replace(cfg.model, chat_template=None))
    try:
        with replacing(out) as folder:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            (folder / RUN_CONFIG).write_text(dump_yaml(cfg))
    except LinkError:  # its own line: the link and the fix
        raise
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk, a read-only folder
        raise ExportError(
            f"could not write the export to {out}: {write_cause(out.absolute().parent, exc)}; "
            "free disk space or choose another --out (a previous export there is intact)"
        ) from exc
    return ckpt
