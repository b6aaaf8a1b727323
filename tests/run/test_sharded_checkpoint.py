"""Checkpoints in rank shards (cod_fast.run.sharded), in one process: FSDP2's row arithmetic, the
ranges a rank of another world size reads, the rank files' safetensors layout, and checkpoints
written as W ranks write them (each rank's rows of a real model and AdamW state, through the
functions the ranks call) read back whole and in rows, refused in one line when damaged.

The multi-process side (FSDP2 under gloo, resume at other world sizes, a failing rank, memory)
is tests/distributed/test_sharded_resume.py."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from cod_fast.distributed.context import DistContext
from cod_fast.distributed.fsdp import (
    Shard,
    chunk_rows,
    load_model_shards,
    model_shards,
    model_state,
    overlaps,
)
from cod_fast.distributed.optim_state import (
    load_optimizer_shards,
    optimizer_shards,
    optimizer_state,
)
from cod_fast.run import sharded
from cod_fast.run.checkpoint import (
    CheckpointError,
    begin_checkpoint,
    complete_checkpoints,
    finish_checkpoint,
    latest_checkpoint,
    read_model_state,
    read_optimizer_state,
    restoring,
)
from cod_fast.run.sharded import (
    INDEX,
    PLAIN,
    rank_file,
    read_index,
    read_plain,
    read_rows,
    write_rank_files,
    write_tensors,
)

ONE = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


# --- the row arithmetic -----------------------------------------------------------------------


def _sizes(rng: random.Random) -> list[int]:
    """Dim-0 sizes: empty, tiny, around the world sizes, and a few random larger ones."""
    return [0, 1, 2, 3, 5, 7, 8, 9, 10, 17, *(rng.randrange(11, 300) for _ in range(6))]


def test_chunk_rows_are_fsdp2s_shards():
    """For world sizes 1..9 and dim-0 sizes from 0 up, rank r's rows are those of FSDP2's own
    split (_chunk_with_empty: torch.chunk, then empty chunks), uneven last and empty ones
    included."""
    rng = random.Random(torch.seed())
    for rows in _sizes(rng):
        tensor = torch.arange(rows)
        for world in range(1, 10):
            chunks = _chunk_with_empty(tensor, world, dim=0)
            for rank, chunk in enumerate(chunks):
                start, stop = chunk_rows(rows, world, rank)
                assert torch.equal(tensor[start:stop], chunk), (rows, world, rank)


def test_a_rank_of_any_world_size_reads_exactly_its_rows():
    """Saved by W ranks, read by V (both 1..9): each new rank's reads take rows of the saved
    pieces only, fill its own rows exactly once, and give them the saved values."""
    rng = random.Random(torch.seed())
    for rows in _sizes(rng):
        full = torch.randn(rows, 3)
        for saved in range(1, 10):
            pieces = [(r, *chunk_rows(rows, saved, r)) for r in range(saved)]
            pieces = [p for p in pieces if p[2] > p[1]]
            for world in range(1, 10):
                for rank in range(world):
                    start, stop = chunk_rows(rows, world, rank)
                    got = torch.full((stop - start, 3), float("nan"))
                    filled = torch.zeros(stop - start, dtype=torch.int64)
                    for owner, source, target in overlaps(pieces, start, stop):
                        first, last = next(p[1:] for p in pieces if p[0] == owner)
                        assert 0 <= source.start < source.stop <= last - first
                        got[target] = full[first:last][source]
                        filled[target] += 1
                    assert bool((filled == 1).all()), (rows, saved, world, rank)
                    assert torch.equal(got, full[start:stop])


# --- the rank files ---------------------------------------------------------------------------


def test_rank_files_are_safetensors_written_a_tensor_at_a_time(tmp_path, monkeypatch):
    """write_tensors streams each shard's rows into a file safetensors reads back exactly (any
    dtype, empty rows, a 0-dim tensor as one row), its data aligned, and brings to the host
    exactly the rows it writes, one tensor at a time (host_rows)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    tensors = {
        "w": torch.randn(7, 5, generator=g),
        "h": torch.randn(9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 2, 2, generator=g).to(torch.float16),
        "ids": torch.randint(0, 9, (4,), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
    }
    shards = {}
    for name, t in tensors.items():
        rows = t.shape[0] if t.dim() else 1
        start, stop = chunk_rows(rows, 3, 1) if t.dim() else (0, 1)
        local = t[start:stop] if t.dim() else t
        shards[name] = Shard(local, tuple(t.shape), start, stop, True)
    copied = []
    real = sharded.host_rows
    monkeypatch.setattr(sharded, "host_rows", lambda t: copied.append(real(t)) or copied[-1])
    path = tmp_path / "model-rank00001.safetensors"
    size = write_tensors(path, shards)
    assert size == path.stat().st_size
    back = load_file(path)
    for name, shard in shards.items():
        assert torch.equal(back[name], shard.local.reshape(back[name].shape)), name
    header = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header % 8 == 0
    assert sum(c.numel() * c.element_size() for c in copied) == size - 8 - header
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_slice("w")[1:2], shards["w"].local[1:2])


# --- checkpoints as W ranks write them ---------------------------------------------------------


class _Toy(torch.nn.Module):
    """A policy stand-in (`.model`) with odd shapes: uneven and empty dim-0 sizes, a 0-dim
    parameter, a bf16 one, persistent buffers (int and 0-dim)."""

    def __init__(self, rng: random.Random):
        super().__init__()
        self.model = torch.nn.Module()
        sizes = [rng.randrange(1, 40), rng.randrange(2, 9), 0, 1]
        self.model.a = torch.nn.Parameter(torch.randn(sizes[0], 3))
        self.model.b = torch.nn.Parameter(torch.randn(sizes[1]))
        self.model.c = torch.nn.Parameter(torch.randn(sizes[2], 2))
        self.model.d = torch.nn.Parameter(torch.randn(sizes[3], 2, 2))
        self.model.e = torch.nn.Parameter(torch.tensor(0.5))
        self.model.register_buffer("ids", torch.arange(rng.randrange(1, 12)))
        self.model.register_buffer("scale", torch.tensor(3.0))


def _trained(seed: int) -> tuple[_Toy, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    toy = _Toy(random.Random(seed))
    optimizer = torch.optim.AdamW(toy.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        loss = sum((p.float() ** 2).sum() * (i + 1) for i, p in enumerate(toy.parameters()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return toy, optimizer


def _split(whole: dict, world: int, rank: int) -> dict:
    """Rank `rank`'s shards of one process's whole ones, as FSDP2 lays out W ranks."""
    out = {}
    for key, shard in whole.items():
        if not shard.shape:  # not sharded: the main rank writes it
            out[key] = Shard(shard.local, (), 0, 1, rank == 0)
            continue
        start, stop = chunk_rows(shard.shape[0], world, rank)
        out[key] = Shard(shard.local[start:stop], shard.shape, start, stop, True)
    return out


def _save_as_ranks(run_dir: Path, step: int, toy, optimizer, world: int) -> Path:
    """Checkpoint `step` in rank shards, written as `world` ranks write it: the main rank's
    begin, every rank's files, the main rank's finish."""
    model = model_shards(toy, ONE)
    plain, slots = optimizer_shards(toy, optimizer, ONE)
    tmp = begin_checkpoint(run_dir, step)
    reports = [
        write_rank_files(tmp, r, _split(model, world, r), _split(slots, world, r))
        for r in range(world)
    ]
    extra = {"world_size": world}
    return finish_checkpoint(run_dir, step, tmp, extra=extra, shards=(reports, world, plain))


def assert_same(got, want, where: str = "") -> None:
    """Equal nested states: tensors bit for bit (dtype included), the rest by ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), (where, set(got) ^ set(want))
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("world", [1, 3, 4, 9])
def test_one_process_gathers_a_sharded_checkpoint_whole(tmp_path, world):
    """Written by W ranks (uneven and empty shards, a 0-dim parameter and buffer), the
    checkpoint reads back in one process as exactly the full model and AdamW state (betas a
    tuple, the step a float32 tensor), the format recorded in meta.json."""
    toy, optimizer = _trained(world)
    _save_as_ranks(tmp_path, 1, toy, optimizer, world)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.sharded and ckpt.model_file == INDEX
    assert sorted(n for n in ckpt.sizes if n.endswith(".safetensors")) == sorted(
        rank_file(kind, r) for kind in ("model", "optim") for r in range(world)
    )
    assert_same(read_model_state(ckpt), model_state(toy, ONE))
    assert_same(read_optimizer_state(ckpt), optimizer_state(toy, optimizer, ONE))


def test_ranks_of_other_world_sizes_read_their_rows_from_the_overlapping_files(
    tmp_path, monkeypatch
):
    """Saved by 4 ranks, read by 2 and 3: each rank gets exactly its chunk rows of every tensor
    and slot, opens only the rank files whose rows overlap its own, and loads them (here into
    a one-process copy: all rows) to the saved model and optimizer, bit for bit."""
    toy, optimizer = _trained(5)
    _save_as_ranks(tmp_path, 1, toy, optimizer, 4)
    ckpt = latest_checkpoint(tmp_path)
    index = read_index(ckpt.path / INDEX, ckpt.sizes)
    full = read_model_state(ckpt)
    opened = []
    real_open = sharded.safe_open
    monkeypatch.setattr(
        sharded, "safe_open", lambda p, **kw: opened.append(p) or real_open(p, **kw)
    )
    for world in (2, 3):
        for rank in range(world):
            mine = {
                name: chunk_rows(entry.shape[0], world, rank) if entry.shape else (0, 1)
                for name, entry in index.model.items()
            }
            opened.clear()
            got = read_rows(ckpt.path, index.model, "model", mine)
            for name, (start, stop) in mine.items():
                want = full[name].reshape(-1, *full[name].shape[1:])[start:stop]
                assert torch.equal(got[name].reshape(want.shape), want), (world, rank, name)
            needed = {
                rank_file("model", owner)
                for name, (start, stop) in mine.items()
                for owner, _, _ in overlaps(index.model[name].pieces, start, stop)
            }
            assert {Path(p).name for p in opened} == needed, (world, rank)
    fresh, fresh_opt = _trained(5)  # same shapes; other values once loaded
    torch.nn.init.zeros_(fresh.model.a)
    whole = {n: (0, e.shape[0] if e.shape else 1) for n, e in index.model.items()}
    load_model_shards(fresh, read_rows(ckpt.path, index.model, "model", whole), ONE)
    slots = {k: whole[k[0]] for k in index.optim}
    rows = read_rows(ckpt.path, index.optim, "optim", slots)
    load_optimizer_shards(fresh, fresh_opt, read_plain(ckpt.path / PLAIN), rows, ONE)
    assert_same(model_state(fresh, ONE), model_state(toy, ONE))
    assert_same(optimizer_state(fresh, fresh_opt, ONE), optimizer_state(toy, optimizer, ONE))


# --- damage -----------------------------------------------------------------------------------


def _two_checkpoints(run_dir: Path) -> Path:
    """Steps 1 and 2 written by 4 ranks; the folder of step 2."""
    toy, optimizer = _trained(2)
    for step in (1, 2):
        _save_as_ranks(run_dir, step, toy, optimizer, 4)
    return run_dir / "checkpoints" / "step-0000002"


def _one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def _refused(read, *args) -> str:
    with pytest.raises(CheckpointError) as err:
        read(*args)
    return _one_line(str(err.value))


@pytest.mark.parametrize("kind", ["model", "optim"])
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_short_or_missing_rank_file_is_refused_in_one_line(tmp_path, kind, damage):
    """A rank file cut short or gone: opening the checkpoint names the file, the damage and
    the newest older intact checkpoint to resume from instead."""
    path = _two_checkpoints(tmp_path) / rank_file(kind, 2)
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size - 5])
    said = _refused(latest_checkpoint, tmp_path)
    assert said.startswith(f"{path} is {damage}"), said
    assert "the newest older intact checkpoint is step-0000001" in said


def _tensor_bytes(path: Path, name: str) -> tuple[int, int]:
    """Where tensor `name`'s data lies in a safetensors file: (offset, length)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    first, last = json.loads(data[8 : 8 + size])[name]["data_offsets"]
    return 8 + size + first, last - first


def _overwrite(path: Path, name: str, value: float) -> None:
    offset, length = _tensor_bytes(path, name)
    data = bytearray(path.read_bytes())
    data[offset : offset + length] = torch.full((length // 4,), value).numpy().tobytes()
    path.write_bytes(bytes(data))


def test_rows_a_model_or_optimizer_would_not_take_are_refused_naming_their_file(tmp_path):
    """Rank files of the written size whose values are NaN weights or a negative second
    moment: reading them, in one process or as a rank reads its rows, is one line naming the
    rank file and the damage (the same value checks as a checkpoint of one file)."""
    folder = _two_checkpoints(tmp_path)
    model, optim = folder / rank_file("model", 1), folder / rank_file("optim", 1)
    _overwrite(model, "a", float("nan"))
    _overwrite(optim, "a/exp_avg_sq", -1.0)
    ckpt = latest_checkpoint(tmp_path)
    said = _refused(read_model_state, ckpt)
    assert said.startswith(f"{model} holds non-finite values in tensor a"), said
    said = _refused(read_optimizer_state, ckpt)
    assert said.startswith(f"{optim} is damaged (the optimizer checkpoint's exp_avg_sq of a"), said
    index = read_index(ckpt.path / INDEX, ckpt.sizes)
    start, stop = chunk_rows(index.model["a"].shape[0], 2, 0)  # rank 0 of 2 overlaps rank 1 of 4

    def rank_reads() -> None:
        with restoring(ckpt, INDEX):
            read_rows(ckpt.path, index.model, "model", {"a": (start, stop)})

    assert _refused(rank_reads).startswith(f"{model} holds non-finite values in tensor a")


def _edit_index(folder: Path, edit) -> Path:
    """index.json changed by `edit`, its size in meta.json too (an edited copy, not a cut)."""
    path = folder / INDEX
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))
    meta = json.loads((folder / "meta.json").read_text())
    meta["sizes"][INDEX] = path.stat().st_size
    (folder / "meta.json").write_text(json.dumps(meta))
    return path


INDEX_EDITS = {
    "a gap": (lambda i: i["model"]["a"]["pieces"].pop(), "do not cover"),
    "a rank without a file": (
        lambda i: i["model"]["a"]["pieces"][0].__setitem__(0, 7),
        "rank00007",
    ),
    "a huge shape": (lambda i: i["model"]["a"].__setitem__("shape", [2**40, 2**40]), "larger"),
    "a shape beyond the files": (
        lambda i: i["model"]["ids"].update(shape=[10**9], pieces=[[0, 0, 10**9]]),
        "more than the",
    ),
    "another dtype": (lambda i: i["model"]["a"].__setitem__("dtype", "pickle"), "dtype"),
    "no version": (lambda i: i.pop("version"), "version 1"),
}


@pytest.mark.parametrize("edit", list(INDEX_EDITS))
def test_an_index_that_does_not_describe_its_files_is_refused_before_any_read(tmp_path, edit):
    """An index whose pieces leave a gap, name a rank file the checkpoint lacks, declare a
    shape no model has or more bytes than the files hold, or another dtype: one line naming
    index.json, before a tensor is allocated or read."""
    change, words = INDEX_EDITS[edit]
    path = _edit_index(_two_checkpoints(tmp_path), change)
    said = _refused(read_model_state, latest_checkpoint(tmp_path))
    assert said.startswith(f"{path} is damaged") and words in said, said
    assert "step-0000001" in said


def test_a_rank_file_whose_tensor_is_not_the_index_s_is_refused(tmp_path):
    """A rank file whose header declares another shape than the index says (a piece from
    another checkpoint, say) is refused naming it, not read into the wrong rows."""
    folder = _two_checkpoints(tmp_path)
    path = folder / rank_file("model", 0)
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    rows, cols = header["a"]["shape"]
    header["a"]["shape"] = [cols, rows]  # the same bytes, another shape
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    path.write_bytes(data[:8] + text + data[8 + size :])
    said = _refused(read_model_state, latest_checkpoint(tmp_path))
    assert said.startswith(f"{path} is damaged (its tensor a is F32 [{cols}, {rows}]"), said


# --- interrupted saves ------------------------------------------------------------------------


def test_a_save_some_ranks_never_finished_is_not_a_checkpoint(tmp_path):
    """Two of four ranks wrote their files when the save stopped (no meta.json): the folder
    is no checkpoint (latest and the complete list stay at step 1), and the next save of the
    step replaces it with a whole one and leaves nothing behind."""
    toy, optimizer = _trained(3)
    _save_as_ranks(tmp_path, 1, toy, optimizer, 4)
    model = model_shards(toy, ONE)
    _, slots = optimizer_shards(toy, optimizer, ONE)
    tmp = begin_checkpoint(tmp_path, 2)
    for rank in (0, 1):
        write_rank_files(tmp, rank, _split(model, 4, rank), _split(slots, 4, rank))
    assert latest_checkpoint(tmp_path).step == 1
    assert complete_checkpoints(tmp_path) == ["step-0000001"]
    _save_as_ranks(tmp_path, 2, toy, optimizer, 4)
    assert latest_checkpoint(tmp_path).step == 2
    assert_same(read_model_state(latest_checkpoint(tmp_path)), model_state(toy, ONE))
    assert list((tmp_path / "checkpoints").glob(".step-*")) == []


def test_a_rank_file_the_main_rank_cannot_see_fails_the_save(tmp_path):
    """A rank whose file is not in the folder as rank 0 sees it (a node without the shared
    file system): the save fails in one line saying so, its folder is removed, and the
    previous checkpoint stays the latest, intact."""
    toy, optimizer = _trained(4)
    _save_as_ranks(tmp_path, 1, toy, optimizer, 4)
    model = model_shards(toy, ONE)
    plain, slots = optimizer_shards(toy, optimizer, ONE)
    tmp = begin_checkpoint(tmp_path, 2)
    reports = [write_rank_files(tmp, r, _split(model, 4, r), _split(slots, 4, r)) for r in range(4)]
    (tmp / rank_file("optim", 3)).unlink()
    with pytest.raises(CheckpointError) as err:
        finish_checkpoint(tmp_path, 2, tmp, shards=(reports, 4, plain))
    said = _one_line(str(err.value))
    assert f"rank 3 wrote {rank_file('optim', 3)}" in said and "every node shares" in said
    assert not tmp.exists() and latest_checkpoint(tmp_path).step == 1
    assert_same(read_model_state(latest_checkpoint(tmp_path)), model_state(toy, ONE))
