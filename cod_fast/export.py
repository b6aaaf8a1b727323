"""`cod-fast export`: a run's checkpoint as a Hugging Face model folder.

The folder (config, safetensors weights, tokenizer) loads with `from_pretrained` anywhere,
vLLM and `cod-fast eval` included. The model is rebuilt from the run's own config.yaml (the
built-in model from its sizes and the run's tokenizer), then given the checkpoint's weights, and
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

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from cod_fast.checkpoint import (
    Checkpoint,
    checkpoint_at,
    complete_checkpoints,
    latest_checkpoint,
    read_model_state,
)
from cod_fast.config import Config
from cod_fast.config_io import dump_yaml, load_config
from cod_fast.distributed import DistContext, load_model_state
from cod_fast.model import BUILTIN_TINY, load_policy, resolve_dtype
from cod_fast.policy import Policy
from cod_fast.rollout.chat import read_template
from cod_fast.tokenizer import load_saved_tokenizer

RUN_CONFIG = "cod_fast_run.yaml"
"""The run's resolved config, in an exported model folder."""


def read_run_config(folder: str | Path) -> Config | None:
    """The config of the run a model folder was exported from, or None for any other model."""
    path = Path(folder) / RUN_CONFIG
    return load_config(path=str(path)) if path.exists() else None


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
    removes its folder; a killed one's leftovers are removed by the next export to `out`."""
    place = out.absolute()  # `--out .` has a name to put beside
    tmp = place.with_name(f".{place.name}.export-tmp")
    old = place.with_name(f".{place.name}.export-old")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if place.exists():
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
    cfg = load_config(path=str(config))
    ckpt = _checkpoint(run_dir, step)
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
    load_model_state(Policy(model), weights, one_process)
    model.set_attn_implementation("sdpa")
    if cfg.model.chat_template is not None:
        # The run's template goes into the exported tokenizer, so the folder renders prompts as
        # the run did wherever it is loaded (the template's file need not travel with it).
        tokenizer.chat_template = read_template(cfg.model.chat_template)
        cfg = replace(cfg, model=replace(cfg.model, chat_template=None))
    with replacing(out) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / RUN_CONFIG).write_text(dump_yaml(cfg))
    return ckpt
