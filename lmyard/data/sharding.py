"""Tokenize-and-shard: text sources -> token shards + manifest in the store.

The shard set's address hashes what determines its bytes: the sources'
fingerprints (and shares, for a mixture), the tokenizer's identity and its
document separators, the shard size, the split rule, the shuffle (seed
included) and the format. Same inputs -> same address -> the existing set is
reused.

Each document is written as its separators around its tokens: by default
<|endoftext|> followed by its tokens (llm.c's convention), so exactly one
end-of-text separates consecutive documents; a tokenizer.json declares its own
(tokenizer.bos before, tokenizer.eos after). Document i of the final order
goes to validation when i % data.val_every == 0, else to train.

Parallel, ordered, bounded
--------------------------
A pool of `data.num_proc` processes (default: every core) does the work in
tasks. Local and S3 files are cut into read tasks (`sources.Unit`: ~1 MiB
byte ranges of JSONL, whole small files, parquet row groups) that a process
reads, decodes and tokenizes itself; hub datasets are read by the main
process and sent in batches of about 1 MiB of text. Each source's results are
taken in submission order, so the token stream -- and every shard byte -- is
the same for any number of processes. At most 2 tasks per process and source
are in flight, and tokens go to a local shard file as they arrive (never a
shard-sized buffer in memory), so peak memory depends on the task size and
the process count, not on the corpus or the shard size. A full shard is
hashed and uploaded (boto3's managed multipart transfer on S3) by a
background thread while tokenizing goes on; at most two shards wait for it,
which bounds the local disk used.

Mixtures
--------
`data.sources` lists sources with weights or token budgets. Their documents
are interleaved one at a time: the next document comes from the source whose
tokens so far, divided by its weight, are lowest (ties: the first listed), so
every prefix of the stream holds each source's share to within a document.
With weights the mixture ends when its first source runs out; with budgets
each source gives documents until its budget is met, read again from its
start if it runs out first.

Shuffle (data.shuffle_documents)
--------------------------------
The read tasks of each file source go in a seeded order, and the mixed stream
passes a seeded shuffle buffer of data.shuffle_buffer_tokens tokens: each
document waits there and leaves at a random turn. The order depends on the
seed and the inputs only, so the shards stay reproducible; the seed is in the
address. The loader's per-epoch order of sequences (data.shuffle_sequences,
lmyard.data) is the other, independent shuffle.

Resume
------
After shard `<split>_NNNNNN.bin` is uploaded, a sidecar `<split>_NNNNNN.json`
is written next to it: the shard's manifest entry (tokens, bytes, sha256) and
the split's cursor at the shard's end -- `doc`, the index of the document
whose tokens end the shard, and `doc_tokens`, how many of that document's
tokens (its separators included) this and earlier shards hold.

A run that finds no manifest at its address looks for sidecars. For each
split it keeps the longest run of shards 0, 1, 2, ... whose sidecar exists
and whose bytes in the store hash to the sidecar's sha256; the first shard
that fails the check, and all after it, are written again. Shard numbers
continue after the kept ones. For one unshuffled `data.source` the kept shards
are not tokenized again: documents before a split's cursor are read but not
tokenized (file read tasks then run one at a time until both cursors are
passed, since a task's first document index is known only after the task
before it), and the cursor's document only contributes its tokens from
`doc_tokens` on. A mixture or a shuffled stream is tokenized again from the
start (the interleaving depends on every document's token count) and only the
kept shards' writes are skipped. The token stream is deterministic, so the
shards written after a resume are byte-identical to those of an uninterrupted
run. The manifest is written last: without it the shard set does not exist.
A source too small to give both splits tokens fails with a UserError, and the
shards it wrote are deleted first: the same inputs would fail again, so no
attempt could ever resume from them.
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
        return _build(cfg, store, pool, num_proc, sources, enc, address, key, log, cache_dir, progress), False
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _build(
    cfg: RunConfig,
    store: Store,
    pool,
    num_proc: int,
    sources: list[Source],
    enc,
    address: str,
    key: dict,
    log,
    cache_dir: str,
    progress,
) -> fmt.ShardSet:
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
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmyard-shard-", dir=cache_dir) as tmp:
        uploader = Uploader(store, layout)
        readers = _readers(cfg, sources, pool, num_proc, kept)
        try:
            writers = {
                s: ShardWriter(s, d.shard_tokens, version, tmp, uploader, address, kept[s][0], kept[s][1])
                for s in SPLITS
            }
            report = _reporter(sources, readers, writers, stats, log, progress)
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
    return _finish(cfg, store, layout, sources, address, key, version, dtype, entries, counts, stats, log, report)


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


def _finish(cfg, store, layout, sources, address, key, version, dtype, entries, counts, stats, log, report):
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
        manifest["mixture"] = [
            {"source": c.source, "documents": n, "tokens": t} for c, (n, t) in zip(cfg.data.sources, counts)
        ]
        log(
            "mixture: "
            + ", ".join(
                f"{m['source']} {m['tokens']:,} tokens ({100 * m['tokens'] / max(sum(t for _, t in counts), 1):.1f}%)"
                for m in manifest["mixture"]
            )
        )
    store.write_bytes(layout.manifest, json.dumps(manifest, indent=1).encode())
    report(done=True)
    log(
        f"wrote shard set {address}: {docs:,} documents, {tokens['train']:,} train + {tokens['val']:,} val tokens "
        f"in {elapsed:.1f}s ({stats['tokens'] / max(elapsed, 1e-9):,.0f} tokens/s tokenized in this attempt)"
    )
    return fmt.ShardSet(address=address, uri=store.uri(layout.root), manifest=manifest)
