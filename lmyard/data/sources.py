"""Text sources through HF `datasets`, each with a content fingerprint.

`data.source` is `builtin:pydoc-topics` (CPython's bundled documentation, offline: the smoke corpus), a local
file or glob (.txt, .jsonl/.json, .parquet), s3://bucket/key-or-glob, or a Hugging Face hub dataset name.
Files are read in `Unit`s (`read_unit`) that the tokenizer processes read themselves.

Design notes: docs/data.md, `lmyard/data/sources.py`.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import gzip
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmyard.config import DataConfig
from lmyard.errors import UserError
from lmyard.paths import confined
from lmyard.store import s3_client, s3_errors

BUILTIN_PYDOC = "builtin:pydoc-topics"
_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
UNIT_BYTES = 1 << 20  # one read task: ~1 MiB of input, ~50-100 ms of one core's BPE


@dataclass(frozen=True)
class Piece:
    path: str  # the local file read
    name: str  # the file as the user knows it (path or s3:// URI)
    start: int  # byte range [start, end) of a .jsonl file; the row group of a parquet file in `start`
    end: int


@dataclass(frozen=True)
class Unit:
    """One read task: pieces of files read in order by one tokenizer process."""

    builder: str  # text | json | parquet
    pieces: tuple[Piece, ...]
    text_field: str
    on_error: str
    nbytes: int


@dataclass
class Source:
    kind: str
    fingerprint: dict
    _documents: Callable[[], Iterator[str]] = field(repr=False)
    size_bytes: int | None = None  # bytes of input, when known: a base for progress estimates
    skipped: dict[str, int] = field(default_factory=dict)  # file -> documents dropped for non-UTF-8 bytes
    units: Callable[[], list[Unit]] | None = field(default=None, repr=False)  # files: the read tasks, in order

    def documents(self) -> Iterator[str]:
        """Document texts in a fixed order."""
        return self._documents()


PYDOC_TOPICS = Path(__file__).with_name("pydoc_topics.json.gz")  # CPython 3.11.7's pydoc_data.topics
PYDOC_TOPICS_FROM = "cpython-3.11.7"


def _pydoc_topics() -> Source:
    topics = json.loads(gzip.decompress(PYDOC_TOPICS.read_bytes()))
    keys = sorted(topics)
    h = hashlib.sha256()
    for k in keys:
        h.update(k.encode())
        h.update(topics[k].encode())
    fp = {"kind": "builtin", "name": "pydoc-topics", "from": PYDOC_TOPICS_FROM, "sha256": h.hexdigest()}
    return Source("builtin", fp, lambda: (topics[k] for k in keys), size_bytes=sum(len(topics[k]) for k in keys))


# ---------------------------------------------------------------- UTF-8 checks


def _scan(path: str, check_utf8: bool) -> tuple[str, int | None]:
    """(sha256 of the file, offset of its first non-UTF-8 byte or None), in one read."""
    h = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    pos, bad = 0, None
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            if check_utf8 and bad is None:
                pending = len(decoder.getstate()[0])  # bytes of a split character carried from the last block
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    bad = pos - pending + e.start
            pos += len(block)
    if check_utf8 and bad is None:
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            bad = pos - pending + e.start
    return h.hexdigest(), bad


def _decode_error(where: str, offset: int) -> UserError:
    return UserError(
        f"{where}: byte offset {offset} is not UTF-8; re-encode the file as UTF-8, or set "
        "data.on_decode_error=skip to drop the documents holding such bytes"
    )


def _drop_bad_lines(path: str, dest: str) -> int:
    """Copy a .jsonl file without its non-UTF-8 lines; returns how many were dropped."""
    dropped = 0
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(path, "rb") as src, open(dest + ".part", "wb") as out:
        for line in src:
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                dropped += 1
                continue
            out.write(line)
    os.replace(dest + ".part", dest)
    return dropped


def _readable(
    files: list[tuple[str, str, int | None]], builder: str, on_error: str, cache_dir: str, skipped: dict[str, int]
) -> list[tuple[str, str]]:
    """The (path, name) of the files to read, given (local path, name shown to the user, first bad byte)."""
    out = []
    for path, name, bad in files:
        if bad is None:
            out.append((path, name))
        elif on_error == "error":
            raise _decode_error(name, bad)
        elif builder == "json" and path.lower().endswith(".jsonl"):
            clean = os.path.join(cache_dir, "utf8-clean", hashlib.sha256(name.encode()).hexdigest()[:16] + ".jsonl")
            skipped[name] = _drop_bad_lines(path, clean)
            out.append((clean, name))
        else:
            skipped[name] = 1  # one .txt file is one document; a .json array cannot be cut apart
    return out


def _builder_for(paths: list[str]) -> str:
    exts = {os.path.splitext(p)[1].lower() for p in paths}
    builders = {_BUILDERS.get(e) for e in exts}
    if None in builders or len(builders) != 1:
        raise UserError(
            f"data.source: cannot read files with extensions {sorted(exts)}; use one kind of {sorted(_BUILDERS)}"
        )
    return next(b for b in builders if b is not None)


def make_units(
    files: list[tuple[str, str, int]], builder: str, text_field: str, on_error: str, unit_bytes: int | None = None
) -> list[Unit]:
    """Cut (path, name, size) files into read tasks of about unit_bytes, in file order."""
    size = unit_bytes or UNIT_BYTES
    units: list[Unit] = []
    pieces: list[Piece] = []
    nbytes = 0

    def flush() -> None:
        nonlocal pieces, nbytes
        if pieces:
            units.append(Unit(builder, tuple(pieces), text_field, on_error, nbytes))
        pieces, nbytes = [], 0

    for path, name, n in files:
        if builder == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)  # its bytes in the file, for progress against the files' sizes
                group_bytes = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
                units.append(Unit(builder, (Piece(path, name, g, g + 1),), text_field, on_error, group_bytes))
            continue
        splittable = builder == "json" and path.lower().endswith(".jsonl")
        for start in range(0, n, size) if splittable else [0]:
            end = min(start + size, n) if splittable else n
            pieces.append(Piece(path, name, start, end))
            nbytes += end - start
            if nbytes >= size:
                flush()
    flush()
    return units


def read_unit(unit: Unit) -> tuple[list[str], dict[str, int]]:
    """(document texts, {file: documents skipped for non-UTF-8 bytes}) of one read task."""
    texts: list[str] = []
    skipped: dict[str, int] = {}
    for p in unit.pieces:
        if unit.builder == "parquet":
            texts.extend(_row_group_texts(p, unit.text_field))
            continue
        if unit.builder == "json" and p.path.lower().endswith(".jsonl"):
            pos, data = _line_range(p)
            lines = _decoded_lines(data, pos, p, unit.on_error, skipped)
        else:
            with open(p.path, "rb") as f:
                data = f.read()
            if not data:
                continue  # an empty file holds no document
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                if unit.on_error == "error":
                    raise _decode_error(p.name, e.start) from None
                skipped[p.name] = 1
                continue
            if unit.builder == "text":  # as `datasets` reads a text file: universal newlines
                texts.append(text.replace("\r\n", "\n").replace("\r", "\n"))
                continue
            lines = _json_rows(text, p.name)
        texts.extend(_field_texts(lines, p.name, unit.text_field))
    return texts, skipped


def _line_range(p: Piece) -> tuple[int, bytes]:
    """(offset, bytes) of the lines of a .jsonl file that start in [p.start, p.end)."""
    with open(p.path, "rb") as f:
        f.seek(max(p.start - 1, 0))
        if p.start > 0:
            f.readline()  # the line holding byte start-1 belongs to the previous range
        pos = f.tell()
        if pos >= p.end:
            return pos, b""
        data = f.read(p.end - pos)
        if data and not data.endswith(b"\n"):
            data += f.readline()
    return pos, data


def _decoded_lines(data: bytes, pos: int, p: Piece, on_error: str, skipped: dict[str, int]) -> list[str]:
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        if on_error == "error":
            raise _decode_error(p.name, pos + e.start) from None
    lines = []
    for raw in data.split(b"\n"):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            skipped[p.name] = skipped.get(p.name, 0) + 1
    return lines


def _json_rows(text: str, name: str) -> list:
    """A .json file: one array of rows, or JSON lines."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            raise UserError(f"{name}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
        return text.split("\n")
    if isinstance(value, list):
        return value
    return [value]


def _field_texts(rows: list, name: str, text_field: str) -> Iterator[str]:
    """The text field of every row (JSON lines as strings, or parsed values)."""
    for i, row in enumerate(rows):
        if isinstance(row, str):
            if not row.strip():
                continue
            try:
                row = json.loads(row)
            except json.JSONDecodeError as e:
                raise UserError(f"{name}: a line is not valid JSON ({e.msg}: {row[:80]!r}); fix the line") from None
        if not isinstance(row, dict) or text_field not in row:
            fields = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise UserError(
                f"data.text_field {text_field!r} is not in {name} (row {i} has fields "
                f"{fields}); set data.text_field to one of them"
            )
        text = row[text_field]
        if not isinstance(text, str):
            raise UserError(
                f"{name} row {i}: field {text_field!r} holds "
                f"{'nothing' if text is None else type(text).__name__}, not text; "
                "fix the row or set data.text_field to a text field"
            )
        yield text


def _row_group_texts(p: Piece, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(p.path)
    if text_field not in f.schema_arrow.names:
        raise UserError(
            f"data.text_field {text_field!r} is not in {p.name} (its rows have fields "
            f"{sorted(f.schema_arrow.names)}); set data.text_field to one of them"
        )
    column = f.read_row_group(p.start, columns=[text_field]).column(0).to_pylist()
    return list(_field_texts([{text_field: t} for t in column], p.name, text_field))


def _unit_documents(units: Callable[[], list[Unit]], skipped: dict[str, int]):
    def gen() -> Iterator[str]:
        for unit in units():
            texts, bad = read_unit(unit)
            for k, v in bad.items():
                skipped[k] = skipped.get(k, 0) + v
            yield from texts

    return gen


def _texts(ds, text_field: str, where: str) -> Iterator[str]:
    """The text field of every row, read in columnar batches (rows one at a time are ~6x slower)."""
    columns = ds.column_names
    if columns is not None:
        if text_field not in columns:
            raise UserError(
                f"data.text_field {text_field!r} is not in {where} (its rows have fields "
                f"{sorted(columns)}); set data.text_field to one of them"
            )
        ds = ds.select_columns([text_field])
    i = 0
    for batch in ds.iter(batch_size=1000):
        if text_field not in batch:
            raise UserError(
                f"data.text_field {text_field!r} is not in {where} (row {i} has fields "
                f"{sorted(batch)}); set data.text_field to one of them"
            )
        for text in batch[text_field]:
            if not isinstance(text, str):
                raise UserError(
                    f"{where} row {i}: field {text_field!r} holds "
                    f"{'nothing' if text is None else type(text).__name__}, not text; "
                    "fix the row or set data.text_field to a text field"
                )
            yield text
            i += 1


def _local(cfg: DataConfig, cache_dir: str) -> Source:
    pattern = os.path.expanduser(cfg.source.removeprefix("file://"))
    files = (
        sorted(glob.glob(pattern, recursive=True))
        if glob.has_magic(pattern)
        else (
            [pattern]
            if os.path.isfile(pattern)
            else sorted(p for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True) if os.path.isfile(p))
            if os.path.isdir(pattern)
            else []
        )
    )
    if not files:
        raise UserError(f"data.source {cfg.source!r} matches no file")
    builder = _builder_for(files)
    with ThreadPoolExecutor(min(8, len(files))) as pool:  # hashlib releases the GIL: files hash side by side
        shas = list(pool.map(lambda p: _scan(p, check_utf8=False)[0], files))
    entries: list[dict[str, Any]] = [
        {"name": os.path.abspath(p), "size": os.path.getsize(p), "sha256": sha} for p, sha in zip(files, shas)
    ]
    fp = {"kind": "files", "builder": builder, "files": entries}
    skipped: dict[str, int] = {}

    def units() -> list[Unit]:
        return make_units(
            [(p, p, e["size"]) for p, e in zip(files, entries)], builder, cfg.text_field, cfg.on_decode_error
        )

    return Source(
        "files",
        fp,
        _unit_documents(units, skipped),
        size_bytes=sum(e["size"] for e in entries),
        skipped=skipped,
        units=units,
    )


def _s3(cfg: DataConfig, cache_dir: str) -> Source:
    bucket, _, pattern = cfg.source.removeprefix("s3://").partition("/")
    client = s3_client()
    literal = pattern.split("*")[0].split("?")[0].split("[")[0]
    objs: list[dict[str, Any]] = []
    with s3_errors(f"data.source {cfg.source}"):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=literal):
            objs.extend(
                o for o in page.get("Contents", []) if fnmatch.fnmatchcase(o["Key"], pattern) or o["Key"] == pattern
            )
    if not objs:
        raise UserError(f"data.source {cfg.source!r} matches no object")
    for o in objs:
        _cache_path(cache_dir, bucket, o)  # refuses a key that would leave the cache, before anything is read
    builder = _builder_for([o["Key"] for o in objs])
    fp = {
        "kind": "s3",
        "builder": builder,
        "files": [{"name": f"s3://{bucket}/{o['Key']}", "size": o["Size"], "etag": o["ETag"].strip('"')} for o in objs],
    }
    skipped: dict[str, int] = {}

    def fetch() -> list[tuple[str, str]]:
        scanned = []
        for o in objs:
            dest = _fetched(client, bucket, o, cache_dir)
            bad = _scan(dest, check_utf8=builder != "parquet")[1]
            scanned.append((dest, f"s3://{bucket}/{o['Key']}", bad))
        return _readable(scanned, builder, cfg.on_decode_error, cache_dir, skipped)

    def units() -> list[Unit]:  # the files were checked (and cleaned, with `skip`) when fetched
        return make_units([(p, name, os.path.getsize(p)) for p, name in fetch()], builder, cfg.text_field, "error")

    return Source(
        "s3", fp, _unit_documents(units, skipped), size_bytes=sum(o["Size"] for o in objs), skipped=skipped, units=units
    )


def _cache_path(cache_dir: str, bucket: str, obj: dict) -> str:
    etag = hashlib.sha256(obj["ETag"].strip('"').encode()).hexdigest()[:24]
    return confined(os.path.join(cache_dir, "sources", bucket, etag), obj["Key"], f"data.source s3://{bucket} key")


def _fetched(client, bucket: str, obj: dict, cache_dir: str) -> str:
    """The local copy of one listed object, fetched unless the cache holds this very content.

    The copy's folder is named by the object's ETag (its content identity, also in the fingerprint):
    a rewrite with the same size gets a new ETag, so it is fetched again. A key that would leave the
    cache folder (`..` segments) is refused.
    """
    name, dest = f"s3://{bucket}/{obj['Key']}", _cache_path(cache_dir, bucket, obj)
    if not (os.path.exists(dest) and os.path.getsize(dest) == obj["Size"]):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with s3_errors(f"data.source {name}"):
            client.download_file(bucket, obj["Key"], dest + ".part")
        os.replace(dest + ".part", dest)
    return dest


def _hub(cfg: DataConfig) -> Source:
    try:
        from huggingface_hub import HfApi

        info = HfApi().dataset_info(cfg.source, revision=cfg.revision)
    except Exception as e:
        raise UserError(
            f"data.source {cfg.source!r} is not a local file and the hub dataset could not be "
            f"resolved ({type(e).__name__}); check the name, the network, or HF_TOKEN"
        ) from None
    fp = {"kind": "hub", "name": cfg.source, "config": cfg.name, "split": cfg.split, "revision": info.sha}

    def gen() -> Iterator[str]:
        import datasets

        ds = datasets.load_dataset(cfg.source, cfg.name, split=cfg.split, revision=info.sha, streaming=True)
        yield from _texts(ds, cfg.text_field, cfg.source)

    return Source("hub", fp, gen)


def open_source(cfg: DataConfig, cache_dir: str) -> Source:
    if cfg.source == BUILTIN_PYDOC:
        return _pydoc_topics()
    if cfg.source.startswith("builtin:"):
        raise UserError(f"unknown built-in source {cfg.source!r}; the built-in corpus is {BUILTIN_PYDOC!r}")
    if cfg.source.startswith("s3://"):
        return _s3(cfg, cache_dir)
    path = os.path.expanduser(cfg.source.removeprefix("file://"))
    if cfg.source.startswith(("file://", "/", ".", "~")) or glob.has_magic(path) or os.path.exists(path):
        return _local(cfg, cache_dir)
    return _hub(cfg)
