"""From a config to its loaders: each source's tokens (text and JSONL through a token cache), the
held-out split, the mixture, and the loader of the batching mode."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from boost_jax.data.loader import DocumentLoader, MixtureLoader, PackedLoader, TokenLoader
from boost_jax.data.sources import (
    INDEX,
    check_vocab,
    embedded_documents,
    expand_paths,
    parse_mixture,
    prepared_index,
    prepared_shards,
    read_index,
    token_files,
)
from boost_jax.data.tokenizer import load_tokenizer, tokenizer_id

SOURCES = ("embedded", "text", "jsonl", "tokens")  # data.source: where `_tokens` reads from
CACHE_VERSION = 2  # token caches of text/jsonl inputs; 2: with document boundaries


def _sha256(paths, chunk: int = 1 << 22) -> str:
    """The SHA-256 of the files' contents, in order."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def _tokens(source: str, path: str, cfg, tok_id: str, field: str):
    """(token arrays, each array's document end offsets or None where no boundaries are recorded,
    the source's identity: what a checkpoint's data position refers to). `tok_id`: the run's
    tokenizer identity (tokenizer.tokenizer_id), computed once by `build_loaders`."""
    d = cfg.data
    if source == "embedded":
        corpus, ends = embedded_documents(d.embedded_max_bytes)
        ident = {"embedded_sha256": hashlib.sha256(corpus).hexdigest()}
        return [np.frombuffer(corpus, dtype=np.uint8)], [ends], ident
    check = dict(tokenizer=d.tokenizer, vocab_size=cfg.model.vocab_size, tok_id=tok_id)
    if source == "tokens":
        index = prepared_index(path)
        if index is not None:
            return (
                *prepared_shards(index, field, token_dtype=d.token_dtype, **check),
                {"index_sha256": _sha256([index])},
            )
        paths = expand_paths(path, field, (".bin", ".npy"))
        other = [p for p in paths if not p.endswith((".bin", ".npy"))]
        if other:
            raise ValueError(
                f"config field `{field}`: {other[0]} is not a token file (.bin or .npy) nor a directory "
                "made by `python -m boost_jax.data.prepare`; for text set data.source=text (or jsonl)"
            )
        arrays = token_files(paths, d.token_dtype)
        check_vocab(arrays, paths, cfg.model.vocab_size)
        return arrays, None, {"files": [[str(Path(p).resolve()), os.path.getsize(p)] for p in paths]}
    if prepared_index(path) is not None:  # its shard_N.json and index.json are no JSONL corpus
        raise ValueError(
            f"config field `{field}`: {path} is a directory of token shards made by "
            f"`python -m boost_jax.data.prepare`, not {source} files; set data.source=tokens"
        )
    suffixes = (".jsonl", ".json") if source == "jsonl" else (".txt", ".md", ".text")
    cache = _token_cache(expand_paths(path, field, suffixes), cfg, tok_id)
    # The cache was verified against its checksums (the tokens' SHA-256) just now: they name the data.
    ident = {"tokens_sha256": _sha256([cache / "checksums.json"]), "tokenizer": tok_id, "field": d.jsonl_field}
    return (*prepared_shards(cache / "index.json", field, token_dtype=None, **check), ident)


def _token_cache(paths: list[str], cfg, tok_id: str) -> Path:
    """Text and JSONL inputs are tokenised once, into shards under RUN_DIR/token_cache/KEY (KEY: the
    cache version, the tokenizer, the JSONL field and every input's path, size and mtime), by the first
    process only; later starts and the other processes memory-map them. The cache's files carry
    SHA-256 checksums (`checksums.json`), verified when it is opened: a damaged or truncated cache is
    rebuilt, with a note."""
    import shutil

    import jax

    from boost_jax.data.prepare import prepare  # lazy: `python -m boost_jax.data.prepare` runs that module as __main__

    d = cfg.data
    key = json.dumps(
        [
            CACHE_VERSION,
            tok_id,
            d.jsonl_field,
            [[str(Path(p).resolve()), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths],
        ]
    )
    out = Path(cfg.run_dir).expanduser().resolve() / "token_cache" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if jax.process_index() == 0:
        if (out / INDEX).exists() and not _cache_intact(out):
            print(f"note: the token cache {out} is damaged (a file does not match its checksum); rebuilding it")
            shutil.rmtree(out, ignore_errors=True)
        if not (out / INDEX).exists():
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(
                    f"config field `run_dir`: cannot write the token cache {out} ({e.strerror}); "
                    "set --config.run_dir to a writable directory"
                ) from None
            big = sum(os.path.getsize(p) for p in paths) > 256 << 20
            prepare(
                paths,
                out,
                d.tokenizer,
                field=d.jsonl_field,
                workers=min(os.cpu_count() or 1, 8) if big else 0,
                progress=big,
                tok_id=tok_id,
            )
            files = sorted(p.name for p in out.iterdir() if p.name.startswith("shard_") or p.name == INDEX)
            (out / "checksums.json").write_text(json.dumps({f: _sha256([out / f]) for f in files}))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("token_cache")
    return out


def _cache_intact(out: Path) -> bool:
    try:
        sums = json.loads((out / "checksums.json").read_text())
        return all(_sha256([out / f]) == h for f, h in sums.items())
    except (OSError, ValueError):
        return False


def _split_tail(source, fraction: float, whole_documents: bool):
    """Hold out the last `fraction` of the concatenated stream (contiguous, so no leakage); with
    `whole_documents` the cut moves back to the start of the document it falls in (a corpus of one
    document is cut inside it)."""
    segments, ends = source
    total = sum(len(s) for s in segments)
    cut = int(total * (1.0 - fraction))
    train, held, seen = ([], []), ([], []), 0
    for k, s in enumerate(segments):
        lo, hi = seen, seen + len(s)
        e = None if ends is None else np.asarray(ends[k], np.int64)
        at = cut - lo
        if lo < cut < hi and whole_documents and e is not None:
            doc = int(np.searchsorted(e, at, side="right"))  # the document the cut falls in
            start = int(e[doc - 1]) if doc else 0
            if start or lo:  # held out whole (unless that leaves nothing to train on: then it is cut)
                at = start
        if at >= len(s):
            train[0].append(s)
            train[1].append(e)
        elif at <= 0:
            held[0].append(s)
            held[1].append(e)
        else:
            train[0].append(s[:at])
            held[0].append(s[at:])
            if e is not None:
                kept = e[e <= at]
                train[1].append(kept if len(kept) and kept[-1] == at else np.append(kept, at))
                held[1].append(e[e > at] - at)
            else:
                train[1].append(None)
                held[1].append(None)
        seen = hi
    keep = lambda part: (part[0], None if ends is None else part[1])  # noqa: E731
    return keep(train), keep(held)


def _check_mixture(cfg, mixture, field: str) -> None:
    """The prepared directories of a `tokens` mixture must agree on tokenizer, vocabulary and dtype."""
    if cfg.data.source != "tokens" or len(mixture) < 2:
        return
    seen = {}
    for _, path, _ in mixture:
        index = prepared_index(path)
        if index is not None:
            meta = read_index(index, field)
            seen[path] = (meta.get("tokenizer_id"), meta.get("vocab_size"), meta.get("dtype"))
    items = list(seen.items())
    for path, got in items[1:]:
        if got != items[0][1]:
            raise ValueError(
                f"config field `{field}`: the mixed sources {items[0][0]} and {path} were tokenised "
                f"differently (tokenizer, vocab, dtype: {items[0][1]} vs {got}); "
                "prepare them with one tokenizer"
            )


def _one(cfg, source, name: str, field: str, eos_id=None, **common):
    """The loader of one source for data.batching."""
    segments, ends = source
    batching = cfg.data.batching
    if batching == "stream":
        return TokenLoader(segments, name=name, **common)
    if ends is None:
        raise ValueError(
            f"config field `data.batching`: {batching} needs document boundaries, which {name} does "
            f"not record (raw token files, or a directory prepared before they were recorded); "
            f"prepare it with `python -m boost_jax.data.prepare` into a new --out (`{field}`), "
            "or use data.batching=stream"
        )
    _check_targets(ends, name, field, batching)
    if batching == "document":  # a truncated document keeps its EOS, as CoLA's tokenizer call does
        return DocumentLoader(segments, ends, name=name, eos_id=eos_id, **common)
    return PackedLoader(segments, ends, name=name, **common)


def _check_targets(ends, name: str, field: str, batching: str) -> None:
    """Under packed/document batching a target counts only inside its document: data whose every
    document is at most one token long has nothing to learn from (its loss would read 0)."""
    longest = max((int(np.diff(np.asarray(e, np.int64), prepend=0).max()) for e in ends if len(e)), default=0)
    if longest < 2:
        raise ValueError(
            f"config field `{field}`: every document of the {name} is at most {longest} token(s) long, "
            f"so no row holds a target (data.batching={batching} predicts only within a document); "
            "use longer documents, or data.batching=stream to predict across them"
        )


def _loader(
    cfg,
    mixture,
    sources,
    name: str,
    field: str,
    shuffle: bool,
    process_index: int,
    process_count: int,
    order: str,
    eos_id=None,
):
    t = cfg.train
    common = dict(
        seq_len=t.seq_len,
        global_batch=t.global_batch,
        vocab_size=cfg.model.vocab_size,
        process_index=process_index,
        process_count=process_count,
        shuffle=shuffle,
        order=order,
        eos_id=eos_id,
    )
    if len(mixture) == 1:
        return _one(cfg, sources[0], f"{name} ({cfg.data.source})", field, seed=cfg.seed, **common)
    loaders = [
        _one(cfg, source, f"{name} ({cfg.data.source} {path})", field, seed=(cfg.seed, k), **common)
        for k, ((_, path, _), source) in enumerate(zip(mixture, sources))
    ]
    return MixtureLoader(
        loaders,
        [w for _, _, w in mixture],
        [n for n, _, _ in mixture],
        seed=cfg.seed,
        global_batch=t.global_batch,
        process_index=process_index,
        process_count=process_count,
    )


def build_loaders(cfg, process_index: int = 0, process_count: int = 1, order: str | None = None):
    """(train loader, eval loader, tokenizer) for a run config. `data.path` (and `data.eval_path`) may
    name a weighted mixture of sources (see `parse_mixture`); without `data.eval_path` the last
    `data.eval_fraction` of every source is held out and mixed with the same weights. `order`: the
    train order's permutation (default data.shuffle; a resumed run passes the one its checkpoint used)."""
    d = cfg.data
    tok = load_tokenizer(d.tokenizer)
    tok_id = tokenizer_id(d.tokenizer)  # what the sources, the token cache and the checkpoints name it by
    if d.tokenizer not in ("", "byte") and tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"config field `model.vocab_size`: {cfg.model.vocab_size} is smaller than the "
            f"tokenizer's {tok.vocab_size}; set --config.model.vocab_size={tok.vocab_size}"
        )
    unused = cfg.model.vocab_size - tok.vocab_size
    if process_index == 0 and unused > max(tok.vocab_size // 8, 128):  # rows no token id can reach
        print(
            f"warning: model.vocab_size={cfg.model.vocab_size} is much larger than the tokenizer's "
            f"{tok.vocab_size} ({d.tokenizer or 'byte'}): {unused} embedding and head rows are never "
            f"a target; set --config.model.vocab_size={tok.vocab_size} (or a multiple of 128 above it)",
            file=sys.stderr,
        )
    mixture = [("embedded", "", 1.0)] if d.source == "embedded" else parse_mixture(d.path, "data.path")
    _check_mixture(cfg, mixture, "data.path")
    read = [_tokens(d.source, path, cfg, tok_id, "data.path") for _, path, _ in mixture]
    sources = [r[:2] for r in read]
    identity = {
        "batching": d.batching,
        "seq_len": cfg.train.seq_len,
        "sources": {path or "embedded": r[2] for (_, path, _), r in zip(mixture, read)},
    }
    if d.eval_path:
        eval_mixture = parse_mixture(d.eval_path, "data.eval_path")
        _check_mixture(cfg, eval_mixture, "data.eval_path")
        train, held = (
            sources,
            [_tokens(d.source, path, cfg, tok_id, "data.eval_path")[:2] for _, path, _ in eval_mixture],
        )
    else:
        eval_mixture = mixture
        train, held = zip(*[_split_tail(s, d.eval_fraction, d.batching != "stream") for s in sources])
    order = order or d.shuffle
    eos = tok.eos_id  # the run's tokenizer is the one the data was prepared with (prepared_shards checks)
    train_loader = _loader(
        cfg, mixture, train, "train data", "data.path", True, process_index, process_count, order, eos
    )
    train_loader.identity = identity  # what the run's data position refers to (checkpoints record it)
    return (
        train_loader,
        _loader(
            cfg,
            eval_mixture,
            held,
            "eval data",
            "data.eval_path" if d.eval_path else "data.path",
            False,
            process_index,
            process_count,
            order,
            eos,
        ),
        tok,
    )


def changed_sources(recorded: dict, now: dict) -> list[str]:
    """What differs between two `identity` records: the sources (by their data.path entry) and the
    fields (data.batching, train.seq_len) whose data position means something else now."""
    diff = [
        f"data.{k}" if k == "batching" else f"train.{k}"
        for k in ("batching", "seq_len")
        if recorded.get(k) != now.get(k)
    ]
    old, new = recorded.get("sources", {}), now.get("sources", {})
    return diff + [name for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
