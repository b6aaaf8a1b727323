"""`cod-fast export`: a run's checkpoint as a Hugging Face model folder.

The folder (config, safetensors weights, tokenizer) loads with `from_pretrained` anywhere,
vLLM and `cod-fast eval` included. The model is rebuilt from the run's own config.yaml (the
built-in model from its sizes and the run's tokenizer), then given the checkpoint's weights, and
saved with the standard SDPA attention, so nothing of cod-fast is needed to load it. The weights
are written in the dtype asked for; by default the run's compute dtype (a mixed-precision run
keeps float32 masters in its checkpoints and computed in bf16: the export is bf16). Beside it
lies the run's resolved config (RUN_CONFIG): `cod-fast eval --model DIR` reads it and evaluates
with the run's own packs, settings and sampling noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from cod_fast.checkpoint import META, Checkpoint, latest_checkpoint, read_model_state
from cod_fast.config import Config
from cod_fast.config_io import dump_yaml, load_config
from cod_fast.distributed import DistContext, load_model_state
from cod_fast.model import BUILTIN_TINY, load_policy, resolve_dtype
from cod_fast.policy import Policy
from cod_fast.tokenizer import load_saved_tokenizer

RUN_CONFIG = "cod_fast_run.yaml"
"""The run's resolved config, in an exported model folder."""


def read_run_config(folder: str | Path) -> Config | None:
    """The config of the run a model folder was exported from, or None for any other model."""
    path = Path(folder) / RUN_CONFIG
    return load_config(path=str(path)) if path.exists() else None


def _checkpoint(run_dir: Path, step: int | None) -> Checkpoint:
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint (checkpoints/latest); export a run directory that "
            "`cod-fast train` wrote, after its first checkpoint"
        )
    if step is None or step == latest.step:
        return latest
    path = run_dir / "checkpoints" / f"step-{step:07d}"
    if not (path / META).exists():
        kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
        raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step}; it keeps {kept}")
    return Checkpoint(path=path, step=step, extra=json.loads((path / META).read_text())["extra"])


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
    `export_dtype`); returns it."""
    run_dir, out = Path(run_dir), Path(out)
    config = run_dir / "config.yaml"
    if not config.exists():
        raise FileNotFoundError(f"{run_dir} has no config.yaml; is it a cod-fast run directory?")
    cfg = load_config(path=str(config))
    ckpt = _checkpoint(run_dir, step)
    tokenizer = None
    if cfg.model.name_or_path == BUILTIN_TINY and (run_dir / "tokenizer").exists():
        tokenizer = load_saved_tokenizer(run_dir / "tokenizer")
    model, tokenizer = load_policy(
        cfg.model, "cpu", cfg.train.seed, tokenizer, dtype=export_dtype(ckpt, cfg, dtype)
    )
    one_process = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None
    )
    load_model_state(Policy(model), read_model_state(ckpt), one_process)
    model.set_attn_implementation("sdpa")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / RUN_CONFIG).write_text(dump_yaml(cfg))
    return ckpt
