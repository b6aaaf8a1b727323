"""Checkpoints in rank shards: each rank writes, and reads back, its own rows of every tensor.

Under torchrun a checkpoint is not gathered to one process (12 bytes a parameter with AdamW:
96 GB at 8B). Every rank writes its rows of the model state (FSDP2's float32 masters) and of the
optimizer's tensor slots (AdamW's moments) to files of its own, `model-rankNNNNN.safetensors`
and `optim-rankNNNNN.safetensors`, one tensor at a time (`host_rows`), so no process holds more
than its shard; HSDP's first replica alone writes. Beside them, the main rank writes
`index.json`: every tensor's full shape, its dtype and which rank's file holds which rows of dim
0 (FSDP2's chunk rule, cod_fast.distributed.fsdp.chunk_rows; empty shards hold none), and
`optimizer.json`: the optimizer's plain part (hyperparameters, step counts). This is
torchtitan's and verl's way through torch.distributed.checkpoint, in files that run no code:
DCP's reader unpickles its `.metadata` (torch/distributed/checkpoint/filesystem.py,
FileSystemReader.read_metadata), and a run directory may come from anyone.

Loading at any world size, each rank works out the rows it holds now and reads from each file
only the ranges that overlap them (`overlaps`; safetensors' `get_slice` on a memory map), so a
rank's memory is its own shard again; one process (`cod-fast export`, a resume without torchrun)
gathers every tensor whole (`gather_model`, `gather_optimizer`). Every read is bounded: the JSON
files by a cap, a safetensors header by a cap before safetensors parses it, the rows by the
shapes of the index, which must tile each tensor's rows and fit in the files the checkpoint's
meta.json records. A file that does not hold what the index says raises `Damage` naming it. The
folder's atomic write and its damage messages are cod_fast.run.checkpoint's; the bounded readers
a checkpoint of one file shares with this format are here (`read_json`, `load_weights`, and
`check_stored` before torch.load reads ranks.pt or optimizer.pt).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zipfile
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from cod_fast.common.bounded_read import ReadRefused, read_bounded
from cod_fast.common.safe_write import open_fd
from cod_fast.common.values import described, first_words, is_count
from cod_fast.distributed.fsdp import Shard, overlaps
from cod_fast.distributed.optim_state import plain_from_json, plain_to_json, slot_problem

INDEX = "index.json"
PLAIN = "optimizer.json"
"""The optimizer's plain part: param_groups and the scalar slots of every parameter."""
RANK_FILE = re.compile(r"(model|optim)-rank\d{5}\.safetensors")
MAX_JSON_BYTES = 2**26
"""The largest index.json or optimizer.json read: a 27B model on 1024 ranks takes a few MB."""
MAX_HEADER_BYTES = 2**24
"""The largest safetensors header read: a rank file's takes about 100 bytes a tensor."""
MAX_ELEMENTS = 2**48
"""The most elements a tensor of the index may have (counting empty dimensions as 1)."""
_DTYPES = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float64": (torch.float64, "F64"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "bool": (torch.bool, "BOOL"),
}
"""What a tensor of the index may be: its name there, torch's dtype, safetensors' code."""

Kind = Literal["model", "optim"]
Key = str | tuple[str, str]
"""A tensor of the index: a model state name, or (parameter name, slot) of the optimizer."""


class Damage(Exception):
    """A damaged file, as `PATH is truncated (...)`; the caller adds what to do about it,
    which depends on where the file lies."""

    def __init__(self, path: Path, damage: str):
        super().__init__(f"{path} {damage}")


def rank_file(kind: Kind, rank: int) -> str:
    return f"{kind}-rank{rank:05d}.safetensors"


def _file_key(key: Key) -> str:
    """A tensor's name in a rank file: the optimizer's are `parameter/slot`."""
    return key if isinstance(key, str) else "/".join(key)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows_shape(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    """The shape of `rows` rows of a tensor of `shape` (a 0-dim tensor is one row)."""
    return (rows, *shape[1:]) if shape else (rows,)


def nonfinite(name: str, tensor: torch.Tensor) -> str | None:
    """What is wrong with model weights holding NaN or infinite values, or None. They load
    without complaint and fail much later (the sampler's multinomial draw indexes out of
    range), so they are refused as they are read."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return None
    bad = int((~torch.isfinite(tensor)).sum())
    return (
        f"holds non-finite values in tensor {name} ({bad} of its {tensor.numel()} values are NaN "
        "or infinite)"
    )


# --- writing ----------------------------------------------------------------------------------


def host_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory, contiguous: a copy of a device tensor, the tensor itself on the
    CPU. The one place a save brings tensors to the host, one at a time."""
    return tensor.detach().to("cpu").contiguous()


def write_tensors(path: Path, tensors: dict[str, Shard]) -> int:
    """A safetensors file at `path` holding each shard's rows, written and fsynced one tensor at
    a time (safetensors' own save_file builds the whole file in memory first); its size.

    The layout is safetensors' (its README): the header's length as 8 little-endian bytes, the
    JSON header padded with spaces to a multiple of 8, then the tensors back to back in the
    header's order, larger elements first so that each starts aligned to its element size."""
    order = sorted(tensors, key=lambda k: (-tensors[k].local.element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in order:
        shard = tensors[key]
        shape = _rows_shape(shard.shape, shard.stop - shard.start)
        size = math.prod(shape) * shard.local.element_size()
        code = _DTYPES[_dtype_name(shard.local.dtype)][1]
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in order:
            rows = host_rows(tensors[key].local)
            if rows.numel() * rows.element_size() != _span(header[key]):
                raise ValueError(f"the rows of {key} are not the {header[key]['shape']} planned")
            f.write(rows.reshape(-1).view(torch.uint8).numpy())
            del rows  # a device tensor's host copy goes before the next one is made
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + offset


def _span(entry: dict[str, Any]) -> int:
    first, last = entry["data_offsets"]
    return last - first


def write_rank_files(
    folder: Path, rank: int, model: dict[str, Shard], optim: dict[tuple[str, str], Shard]
) -> dict[str, Any] | None:
    """This rank's two files in `folder` (a checkpoint being written), holding the shards it
    writes (empty ones left out), and its report for the index: each file's size, and every
    tensor's (full shape, dtype, start, stop). None, writing nothing, on a rank that writes
    no shard (an HSDP replica after the first)."""
    kinds: dict[Kind, dict[Key, Shard]] = {"model": dict(model), "optim": dict(optim)}
    if not any(s.writes for shards in kinds.values() for s in shards.values()):
        return None
    report: dict[str, Any] = {"rank": rank, "sizes": {}}
    for kind, shards in kinds.items():
        mine = {_file_key(k): s for k, s in shards.items() if s.writes}
        held = {k: s for k, s in mine.items() if s.stop > s.start}
        report["sizes"][rank_file(kind, rank)] = write_tensors(folder / rank_file(kind, rank), held)
        report[kind] = {
            k: (list(s.shape), _dtype_name(s.local.dtype), s.start, s.stop) for k, s in mine.items()
        }
    return report


def write_shared_files(
    folder: Path, reports: list[dict[str, Any]], world_size: int, plain: dict[str, Any]
) -> None:
    """The main rank's part, once every rank has written its files: index.json from the
    ranks' reports, and optimizer.json from the optimizer's plain part."""
    (folder / INDEX).write_text(json.dumps(index_of(reports, world_size)))
    (folder / PLAIN).write_text(json.dumps(plain_to_json(plain)))


def unseen(folder: Path, sizes: dict[str, int], reports: list[dict[str, Any]]) -> str | None:
    """Why a rank file a rank reported is not in `folder` as the main rank sees it (`sizes`),
    or None: on another node it is only there when their file system is shared."""
    for report in reports:
        for name, size in report["sizes"].items():
            if sizes.get(name) != size:
                found = "nothing" if name not in sizes else f"{sizes[name]:,} bytes"
                return (
                    f"rank {report['rank']} wrote {name} ({size:,} bytes) into {folder}, where "
                    f"rank 0 finds {found}: a run of several nodes checkpoints into a "
                    "runtime.run_dir that every node shares (a shared file system)"
                )
    return None


def index_of(reports: Iterable[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """index.json's content from the writing ranks' reports: every tensor's full shape, dtype
    and pieces [rank, start, stop] in row order (a rank with no rows of it has none)."""
    index: dict[str, Any] = {"version": 1, "world_size": world_size, "model": {}, "optim": {}}
    for report in reports:
        for kind in ("model", "optim"):
            for key, (shape, dtype, start, stop) in report[kind].items():
                entry = index[kind].setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
                if stop > start:
                    entry["pieces"].append([report["rank"], start, stop])
    for kind in ("model", "optim"):
        for entry in index[kind].values():
            entry["pieces"].sort(key=lambda piece: piece[1])
    return index


# --- reading ----------------------------------------------------------------------------------


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a whole safetensors file (a one-file checkpoint's model, an exported
    model), every floating-point value finite."""
    try:
        state = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise Damage(path, f"cannot be read ({first_words(exc)})") from None
    for name, tensor in state.items():
        if (problem := nonfinite(name, tensor)) is not None:
            raise Damage(path, problem)
    return state


@dataclass
class Entry:
    """A tensor of the index: its full shape and dtype, and the (rank, start, stop) pieces of
    its rows that rank files hold, in row order, covering every row once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[int, int, int]]


@dataclass
class Index:
    world_size: int
    model: dict[str, Entry]
    optim: dict[tuple[str, str], Entry]


def read_json(path: Path, what: str, cap: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in `path` (at most `cap` bytes), or Damage saying why not; `what` names
    what cod-fast writes there."""
    try:
        return json.loads(read_bounded(path, cap))
    except ReadRefused as exc:  # a file cod-fast never wrote, or no file at all
        raise Damage(path, f"is {exc}, not {what} cod-fast writes") from None
    # JSONDecodeError, UnicodeDecodeError for binary junk, RecursionError for `[[[[...`
    except (ValueError, RecursionError) as exc:
        raise Damage(path, f"is not valid JSON ({first_words(exc)})") from None
    except OSError as exc:  # a folder in its place, no permission
        raise Damage(path, f"cannot be read ({first_words(exc)})") from None


def read_index(path: Path, sizes: dict[str, int]) -> Index:
    """The index at `path`, checked: every tensor's shape and dtype are ones cod-fast writes,
    its pieces tile its rows and lie in rank files the checkpoint records (`sizes`, from its
    meta.json), and all of a kind's tensors fit in its files."""
    data = read_json(path, "an index")

    def damaged(what: str) -> Damage:
        return Damage(path, f"is damaged ({what})")

    if not (isinstance(data, dict) and data.get("version") == 1):
        raise damaged("it is not an index of version 1, the one this version of cod-fast reads")
    if type(data.get("world_size")) is not int:
        raise damaged("it holds no world size")
    entries: dict[str, dict[Any, Entry]] = {}
    for kind in ("model", "optim"):
        tensors = data.get(kind)
        if not isinstance(tensors, dict):
            raise damaged(f"it holds no `{kind}` object of tensors")
        entries[kind] = {}
        for key, raw in tensors.items():
            entry = _entry(raw, kind, sizes)
            if isinstance(entry, str):
                raise damaged(f"its tensor {described(key)} {entry}")
            if kind == "optim" and "/" not in key:
                raise damaged(f"its optimizer tensor {described(key)} names no slot")
            entries[kind][key if kind == "model" else tuple(key.rsplit("/", 1))] = entry
        held = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries[kind].values())
        room = sum(size for name, size in sizes.items() if name.startswith(f"{kind}-rank"))
        if held > room:
            raise damaged(
                f"its {kind} tensors take {held:,} bytes, more than the {room:,} of its files"
            )
    return Index(data["world_size"], entries["model"], entries["optim"])


def _entry(raw: Any, kind: Kind, sizes: dict[str, int]) -> Entry | str:
    """An index entry, or what is wrong with it."""
    if not isinstance(raw, dict):
        return f"is {described(raw)}, not an object"
    shape, dtype, pieces = raw.get("shape"), raw.get("dtype"), raw.get("pieces")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(map(is_count, shape))):
        return f"has a shape of {described(shape)}, not a list of sizes"
    if math.prod(max(n, 1) for n in shape) > MAX_ELEMENTS:
        return f"has a shape of {shape}, larger than any model's"
    if dtype not in _DTYPES:
        return f"has a dtype of {described(dtype)}, not one of {', '.join(_DTYPES)}"
    if not (isinstance(pieces, list) and all(_is_piece(p) for p in pieces)):
        return "has pieces that are not [rank, start, stop] lists of counts"
    rows, at = (shape[0] if shape else 1), 0
    if len({piece[0] for piece in pieces}) < len(pieces):
        return "has two pieces in one rank's file"
    for rank, start, stop in pieces:
        if start != at or stop <= start:
            return f"has pieces that do not cover its {rows} rows once, in order"
        if rank_file(kind, rank) not in sizes:
            return f"lies in {rank_file(kind, rank)}, which the checkpoint does not record"
        at = stop
    if at != rows:
        return f"has pieces that do not cover its {rows} rows once, in order"
    return Entry(tuple(shape), _DTYPES[dtype][0], [tuple(p) for p in pieces])


def _is_piece(piece: Any) -> bool:
    return isinstance(piece, list) and len(piece) == 3 and all(map(is_count, piece))


_ZIP_MAGIC = b"PK\x03\x04"
"""The first bytes by which torch.load tells its zip archive from its legacy format."""


def check_stored(path: Path) -> None:
    """torch.save writes every record of its zip archive stored (uncompressed), but torch.load
    inflates what the archive says, allocating the size its directory claims before reading: a
    deflated record of zeros makes a 3 MB ranks.pt 3 GiB of memory (a zip bomb). So before
    torch reads a byte, every record must be stored and all of them fit in the file. A file
    that is not a zip archive goes to torch's legacy reader, which refuses it as before."""
    try:
        with open(path, "rb") as f:
            if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                return
            records = zipfile.ZipFile(f).infolist()  # reads the central directory alone
    # BadZipFile, and for a damaged directory whatever parsing it meets (ValueError for a name
    # that does not decode, EOFError, struct.error).
    except Exception as exc:
        raise Damage(
            path, f"cannot be read (not a whole zip archive: {first_words(exc)})"
        ) from None
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise Damage(
                path,
                f"is damaged (its record {described(record.filename)} is compressed, which "
                "torch.save never writes; inflating it could take any amount of memory, so the "
                "file was not loaded)",
            )
    claimed, size = sum(record.file_size for record in records), path.stat().st_size
    if claimed > size:
        raise Damage(
            path,
            f"is damaged (its records claim {claimed:,} bytes, more than its {size:,}; torch "
            "would allocate them before reading, so the file was not loaded)",
        )


def read_plain(path: Path) -> dict[str, Any]:
    """optimizer.json, as the optimizer's plain part (optim_state.plain_from_json)."""
    try:
        return plain_from_json(read_json(path, "an optimizer state"))
    except ValueError as exc:
        raise Damage(path, f"is damaged ({exc})") from None


def read_rows(
    folder: Path, entries: dict[Any, Entry], kind: Kind, wanted: dict[Any, tuple[int, int]]
) -> dict[Any, torch.Tensor]:
    """Rows [start, stop) of each wanted tensor (of `entries`, the index's `kind`), read from
    the overlapping ranges of the rank files alone, each rank file opened once; every range
    checked to be the file's tensor of the index's shape and dtype, and its values ones the
    model or the optimizer takes. A 0-dim tensor is one row."""
    out = {}
    with ExitStack() as files:
        opened: dict[int, Any] = {}
        for key, (start, stop) in wanted.items():
            entry = entries[key]
            rows = torch.empty(_rows_shape(entry.shape, stop - start), dtype=entry.dtype)
            for rank, source, target in overlaps(entry.pieces, start, stop):
                path = folder / rank_file(kind, rank)
                if rank not in opened:
                    opened[rank] = files.enter_context(_open(path))
                rows[target] = _piece(opened[rank], path, key, entry, rank, source)
            out[key] = rows
    return out


def _open(path: Path) -> Any:
    """safe_open of a rank file whose header is within MAX_HEADER_BYTES."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or struct.unpack("<Q", head)[0] > MAX_HEADER_BYTES:
            raise Damage(path, "is damaged (its safetensors header is cut or oversized)")
        return safe_open(path, framework="pt")
    except (OSError, SafetensorError) as exc:
        raise Damage(path, f"cannot be read ({first_words(exc)})") from None


def _piece(handle: Any, path: Path, key: Key, entry: Entry, rank: int, rows: slice) -> torch.Tensor:
    """Rows `rows` of piece `key` in an open rank file, checked against the index."""
    piece = next(p for p in entry.pieces if p[0] == rank)
    want = [*_rows_shape(entry.shape, piece[2] - piece[1])]
    code = _DTYPES[_dtype_name(entry.dtype)][1]
    name = _file_key(key)
    try:
        part = handle.get_slice(name)
        if part.get_shape() != want or part.get_dtype() != code:
            raise Damage(
                path,
                f"is damaged (its tensor {name} is {part.get_dtype()} {part.get_shape()}, the "
                f"index says {code} {want})",
            )
        values = part[rows]
    except SafetensorError as exc:
        raise Damage(path, f"cannot be read ({first_words(exc)})") from None
    problem = nonfinite(name, values) if isinstance(key, str) else slot_problem(*key, values)
    if problem is not None:
        raise Damage(path, problem if isinstance(key, str) else f"is damaged ({problem})")
    return values


def gather_model(folder: Path, index: Index) -> dict[str, torch.Tensor]:
    """Every tensor of the model state whole, in one process."""
    whole = {k: (0, e.shape[0] if e.shape else 1) for k, e in index.model.items()}
    rows = read_rows(folder, index.model, "model", whole)
    return {k: rows[k].reshape(index.model[k].shape) for k in whole}


def gather_optimizer(folder: Path, index: Index, plain: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's full state, in one process: torch.distributed's format, as
    cod_fast.distributed.optim_state.optimizer_state gives it (its plain part, then every
    parameter's tensor slots whole)."""
    whole = {k: (0, e.shape[0] if e.shape else 1) for k, e in index.optim.items()}
    rows = read_rows(folder, index.optim, "optim", whole)
    state = {name: dict(slots) for name, slots in plain["state"].items()}
    for (name, slot), tensor in rows.items():
        state.setdefault(name, {})[slot] = tensor.reshape(index.optim[name, slot].shape)
    return {"state": state, "param_groups": plain["param_groups"]}
