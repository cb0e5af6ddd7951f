"""Tokenize-and-shard: text sources -> token shards + manifest in the store.

The shard set's address hashes what determines its bytes: the sources'
fingerprints (and shares, for a mixture), the tokenizer's identity and its
document separators, the shard size, the split rule, the shuffle (seed
included) and the format. Same inputs -> same address -> the existing set is
reused.

Design notes: docs/data.md, `lmyard/data/sharding.py`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmyard.config import RunConfig, digest
from lmyard.data import shards as fmt
from lmyard.data import sources as sources_mod
from lmyard.data.shard_writer import ShardWriter, Uploader, kept_shards
from lmyard.data.sources import Source, open_source
from lmyard.data.token_stream import Reader, mixed, shuffled
from lmyard.data.token_stream import start_pool as _start_pool
from lmyard.data.tokenizer import get_tokenizer, identity, separators
from lmyard.errors import UserError
from lmyard.layout import ShardLayout
from lmyard.paths import cache_root
from lmyard.run import Run
from lmyard.store import Store

SPLITS = ("train", "val")
IN_FLIGHT_PER_PROC = 2  # batches queued per process: keeps every core busy, bounds memory
REPORT_EVERY_S = 5.0


@dataclass(frozen=True)
class Progress:
    """What a watcher sees: counts of this attempt and an estimate of the fraction done."""

    documents: int  # documents read from the source (kept shards' documents included)
    tokens: int  # tokens tokenized in this attempt
    shards: int  # shards complete in the store (kept + written)
    elapsed_s: float
    docs_per_s: float
    tokens_per_s: float
    fraction: float | None  # of the input's bytes read, when the source's size is known
    done: bool = False


# ---------------------------------------------------------------- the stage


def _address_key(cfg: RunConfig, sources: list[Source], enc) -> dict:
    """What decides the shard set's bytes. One unshuffled source keeps the key of earlier lmyard versions."""
    d = cfg.data
    version, _ = fmt.token_dtype(enc.n_vocab)
    key = {
        "tokenizer": identity(enc, cfg.tokenizer),
        "shard_tokens": d.shard_tokens,
        "split": {"rule": "doc_index_mod", "val_every": d.val_every},
        "max_documents": d.max_documents,
        "on_decode_error": d.on_decode_error,
        "format": version,
    }
    if d.sources is None:
        key.update(source=sources[0].fingerprint, text_field=d.text_field)
    else:
        weights, budgets = d.shares()
        key["mixture"] = {
            "rule": "lowest_tokens_over_weight",
            "stop": "budgets" if budgets else "first_exhausted",
            "sources": [
                {"source": src.fingerprint, "text_field": c.text_field, "share": w}
                for src, c, w in zip(sources, d.source_configs(), weights)
            ],
        }
    if d.shuffle_documents:
        key["shuffle"] = {
            "seed": d.shuffle_seed,
            "buffer_tokens": d.shuffle_buffer_tokens,
            "unit_bytes": sources_mod.UNIT_BYTES,
        }
    return key


def plan(cfg: RunConfig, cache_dir: str):
    """(sources, encoding, address, key): everything that decides the shard set, without tokenizing."""
    enc = get_tokenizer(cfg.tokenizer)
    sources = [open_source(c, cache_dir) for c in cfg.data.source_configs()]
    key = _address_key(cfg, sources, enc)
    return sources, enc, digest(key), key


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _describe(cfg: RunConfig) -> str:
    if cfg.data.sources is None:
        return f"data.source {cfg.data.source!r}"
    return "data.sources " + ", ".join(repr(s.source) for s in cfg.data.sources)


def tokenize_and_shard(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    cache_dir: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    start_pool: Callable[[int, tuple], Any] | None = None,
) -> tuple[fmt.ShardSet, bool]:
    """Build (or reuse, or finish) the shard set for cfg.data; returns (shard set, reused?). `log` gets lines
    for people (documents/s and tokens/s every few seconds), `progress` the same figures as a Progress, for a UI;
    `start_pool(num_proc, initargs)`, the read tasks' pool (default: processes here; lmyard.data.raypool).
    """
    cache_dir = cache_dir or cache_root()
    (store := Run.of(cfg).store).check_writable()  # before any tokenizing: the shards and every checkpoint go there
    enc = get_tokenizer(cfg.tokenizer)
    version, dtype = fmt.token_dtype(enc.n_vocab)
    num_proc = cfg.data.num_proc or default_num_proc()
    pool = (start_pool or _start_pool)(num_proc, (enc, *separators(enc, cfg.tokenizer), dtype))  # starts now
    try:
        sources, enc, address, key = plan(cfg, cache_dir)
        existing = fmt.load_manifest(store, address)
        if existing is not None:
            log(f"shard set {address} already complete in {existing.uri}: reusing it, nothing to tokenize")
            if progress:
                progress(
                    Progress(
                        existing.manifest["documents"],
                        0,
                        len(existing.manifest["shards"]),
                        0.0,
                        0.0,
                        0.0,
                        1.0,
                        done=True,
                    )
                )
            return existing, True
        job = _Job(cfg, store, sources, enc, address, key, log, cache_dir, progress)
        return _build(job, pool, num_proc), False
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _Job:
    """One build of a shard set: the run's config and store, its sources and tokenizer, the set's address and
    what it hashes (`key`), where its lines go, the local folder it writes shards in, its progress callback."""

    cfg: RunConfig
    store: Store
    sources: list[Source]
    enc: Any
    address: str
    key: dict
    log: Callable[[str], None]
    cache_dir: str
    progress: Callable[[Progress], None] | None


def _build(job: _Job, pool, num_proc: int) -> fmt.ShardSet:
    cfg, store, sources, enc, address, log = job.cfg, job.store, job.sources, job.enc, job.address, job.log
    d = cfg.data
    layout = ShardLayout(address)
    version, dtype = fmt.token_dtype(enc.n_vocab)
    kept = {s: kept_shards(store, layout, s, address, log) for s in SPLITS}
    if any(entries for entries, _ in kept.values()):
        log(
            f"resuming shard set {address}: {len(kept['train'][0])} train + {len(kept['val'][0])} val shards "
            "from a previous attempt verified and kept"
        )
    log(f"tokenizing {_describe(cfg)} with {enc.name} into {store.uri(layout.root)} ({num_proc} processes)")
    counts = [[0, 0] for _ in sources]
    stats = {"docs": 0, "tokens": 0, "t0": time.perf_counter()}
    os.makedirs(job.cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmyard-shard-", dir=job.cache_dir) as tmp:
        uploader = Uploader(store, layout)
        readers = _readers(cfg, sources, pool, num_proc, kept)
        try:
            writers = {
                s: ShardWriter(s, d.shard_tokens, version, tmp, uploader, address, kept[s][0], kept[s][1])
                for s in SPLITS
            }
            report = _reporter(sources, readers, writers, stats, log, job.progress)
            stream = mixed(readers, *d.shares(), counts)
            if d.shuffle_documents:
                stream = shuffled(stream, d.shuffle_seed, d.shuffle_buffer_tokens)
            _write(stream, writers, d, stats, report)
            uploader.close()
        finally:
            for r in readers:
                r.close()
            uploader.pool.shutdown(wait=True, cancel_futures=True)
        entries = {s: w.entries() for s, w in writers.items()}
    return _finish(job, layout, (version, dtype), entries, counts, stats, report)


def _readers(cfg: RunConfig, sources: list[Source], pool, num_proc: int, kept: dict) -> list[Reader]:
    """One reader per source; for data.source unshuffled, told which documents the kept shards hold."""
    d = cfg.data
    depth = IN_FLIGHT_PER_PROC * num_proc
    skip, last = None, -1
    if d.sources is None and not d.shuffle_documents:  # document i of the stream is document i of the source
        train_doc, val_doc = kept["train"][1]["doc"], kept["val"][1]["doc"]
        if max(train_doc, val_doc) >= 0:
            skip, last = (d.val_every, train_doc, val_doc), max(train_doc, val_doc)
    return [
        Reader(
            src,
            pool,
            depth,
            order_seed=[d.shuffle_seed, 0, k] if d.shuffle_documents else None,
            skip=skip,
            last_skipped=last,
            limit=d.max_documents,
        )
        for k, src in enumerate(sources)
    ]


def _write(stream: Iterator[np.ndarray], writers: dict, d, stats: dict, report) -> None:
    last = time.perf_counter()
    for i, doc in enumerate(stream):
        if d.max_documents is not None and i >= d.max_documents:
            break
        stats["docs"] = i + 1
        writer = writers["val" if i % d.val_every == 0 else "train"]
        if writer.wants(i):
            writer.add(i, doc)
        stats["tokens"] += int(doc.size)
        if time.perf_counter() - last > REPORT_EVERY_S:
            report()
            last = time.perf_counter()
    for w in writers.values():
        w.finish()


def _reporter(sources, readers, writers, stats, log, progress):
    total = sum(s.size_bytes or 0 for s in sources) if all(s.size_bytes for s in sources) else None

    def report(done: bool = False) -> None:
        dt = max(time.perf_counter() - stats["t0"], 1e-9)
        docs, tokens = stats["docs"], stats["tokens"]
        frac = min(sum(r.bytes_done for r in readers) / total, 0.99) if total else None
        p = Progress(
            docs,
            tokens,
            sum(w.shards for w in writers.values()),
            dt,
            docs / dt,
            tokens / dt,
            1.0 if done else frac,
            done,
        )
        if not done:
            pct = f", ~{100 * frac:.0f}% of the input" if frac is not None else ""
            log(
                f"tokenized {docs:,} documents ({p.docs_per_s:,.0f} docs/s), {tokens:,} tokens "
                f"({p.tokens_per_s:,.0f} tokens/s), {p.shards} shards{pct}"
            )
        if progress:
            progress(p)

    return report


def _mixture(cfg, counts, log) -> list[dict]:
    """The manifest's mixture: each source's documents and tokens, logged with its share of the tokens."""
    mixture = [{"source": c.source, "documents": n, "tokens": t} for c, (n, t) in zip(cfg.data.sources, counts)]
    total = max(sum(t for _, t in counts), 1)
    log(
        "mixture: "
        + ", ".join(f"{m['source']} {m['tokens']:,} tokens ({100 * m['tokens'] / total:.1f}%)" for m in mixture)
    )
    return mixture


def _finish(job: _Job, layout: ShardLayout, fmt_version: tuple, entries, counts, stats, report) -> fmt.ShardSet:
    """The manifest, written last (its presence makes the set complete); `fmt_version`: (version, token dtype)."""
    cfg, store, sources, address, key, log = job.cfg, job.store, job.sources, job.address, job.key, job.log
    version, dtype = fmt_version
    docs = stats["docs"]
    if docs == 0:
        raise UserError(f"{_describe(cfg)} holds no documents: check the path, split and filters")
    tokens = {s: sum(e["tokens"] for e in entries[s]) for s in SPLITS}
    for split in SPLITS:
        if tokens[split] == 0:
            # the same inputs always end here: the other split's shards (and sidecars) could never make a set
            store.delete(layout.root)
            raise UserError(
                f"{_describe(cfg)} gave no {split} tokens from {docs} documents; "
                f"add documents or lower data.val_every (now {cfg.data.val_every})"
            )
    if lopsided := fmt.lopsided_split(tokens, cfg.data.val_every):
        log(lopsided)
    skipped = {k: v for s in sources for k, v in s.skipped.items()}
    if skipped:
        log(
            f"warning: skipped {sum(skipped.values()):,} documents holding non-UTF-8 bytes "
            f"(data.on_decode_error=skip) in {len(skipped)} files: {', '.join(sorted(skipped))}"
        )
    elapsed = time.perf_counter() - stats["t0"]
    manifest = {
        "format": {"name": "llm.c-bin", "magic": fmt.MAGIC, "version": version, "dtype": np.dtype(dtype).name},
        "address": address,
        "address_key": key,
        "source": sources[0].fingerprint if len(sources) == 1 else [s.fingerprint for s in sources],
        "tokenizer": key["tokenizer"],
        "documents": docs,
        "skipped_documents": sum(skipped.values()),
        "tokens": tokens,
        "shards": entries["train"] + entries["val"],
        "created_s": round(elapsed, 3),
    }
    if cfg.data.sources is not None:
        manifest["mixture"] = _mixture(cfg, counts, log)
    store.write_bytes(layout.manifest, json.dumps(manifest, indent=1).encode())
    report(done=True)
    log(
        f"wrote shard set {address}: {docs:,} documents, {tokens['train']:,} train + {tokens['val']:,} val tokens "
        f"in {elapsed:.1f}s ({stats['tokens'] / max(elapsed, 1e-9):,.0f} tokens/s tokenized in this attempt)"
    )
    return fmt.ShardSet(address=address, uri=store.uri(layout.root), manifest=manifest)
