"""Data: sources -> token arrays -> a stateless, resumable, process-sharded batch loader."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from boost_jax.data.loader import MixtureLoader, TokenLoader
from boost_jax.data.sources import (check_vocab, embedded_corpus, expand_paths, parse_mixture, prepared_index,
                                    prepared_shards, token_files)
from boost_jax.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["SOURCES", "TokenLoader", "MixtureLoader", "build_loaders", "load_tokenizer", "ByteTokenizer",
           "parse_mixture"]

SOURCES = ("embedded", "text", "jsonl", "tokens")  # data.source: where `_tokens` reads from


def _tokens(source: str, path: str, cfg, tok, field: str) -> list[np.ndarray]:
    d = cfg.data
    if source == "embedded":
        return [np.frombuffer(embedded_corpus(d.embedded_max_bytes), dtype=np.uint8)]
    check = dict(tokenizer=d.tokenizer, vocab_size=cfg.model.vocab_size)
    if source == "tokens":
        index = prepared_index(path)
        if index is not None:
            return prepared_shards(index, field, token_dtype=d.token_dtype, **check)
        paths = expand_paths(path, field, (".bin", ".npy"))
        arrays = token_files(paths, d.token_dtype)
        check_vocab(arrays, paths, cfg.model.vocab_size)
        return arrays
    suffixes = (".jsonl", ".json") if source == "jsonl" else (".txt", ".md", ".text")
    cache = _token_cache(expand_paths(path, field, suffixes), cfg)
    return prepared_shards(cache / "index.json", field, token_dtype=None, **check)


def _token_cache(paths: list[str], cfg) -> Path:
    """Text and JSONL inputs are tokenised once, into shards under RUN_DIR/token_cache/KEY (KEY: the
    tokenizer, the JSONL field and every input's path, size and mtime), by the first process only;
    later starts and the other processes memory-map them."""
    import jax

    from boost_jax.data.prepare import prepare  # lazily: `python -m` runs that module
    from boost_jax.data.sources import INDEX
    from boost_jax.data.tokenizer import tokenizer_id

    d = cfg.data
    key = json.dumps([tokenizer_id(d.tokenizer), d.jsonl_field,
                      [[str(Path(p).resolve()), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths]])
    out = Path(cfg.run_dir).expanduser().resolve() / "token_cache" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if jax.process_index() == 0 and not (out / INDEX).exists():
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"config field `run_dir`: cannot write the token cache {out} ({e.strerror}); "
                             "set --config.run_dir to a writable directory") from None
        big = sum(os.path.getsize(p) for p in paths) > 256 << 20
        prepare(paths, out, d.tokenizer, field=d.jsonl_field, workers=min(os.cpu_count() or 1, 8) if big else 0,
                progress=big)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("token_cache")
    return out


def _split_tail(segments: list[np.ndarray], fraction: float):
    """Hold out the last `fraction` of the concatenated stream (contiguous, so no leakage)."""
    total = sum(len(s) for s in segments)
    cut = int(total * (1.0 - fraction))
    train, held, seen = [], [], 0
    for s in segments:
        lo, hi = seen, seen + len(s)
        if hi <= cut:
            train.append(s)
        elif lo >= cut:
            held.append(s)
        else:
            train.append(s[: cut - lo])
            held.append(s[cut - lo:])
        seen = hi
    return train, held


def _check_mixture(cfg, mixture, field: str) -> None:
    """The prepared directories of a `tokens` mixture must agree on tokenizer, vocabulary and dtype."""
    if cfg.data.source != "tokens" or len(mixture) < 2:
        return
    seen = {}
    for _, path, _ in mixture:
        index = prepared_index(path)
        if index is not None:
            meta = json.loads(index.read_text())
            seen[path] = (meta.get("tokenizer_id"), meta.get("vocab_size"), meta.get("dtype"))
    items = list(seen.items())
    for path, got in items[1:]:
        if got != items[0][1]:
            raise ValueError(f"config field `{field}`: the mixed sources {items[0][0]} and {path} were tokenised "
                             f"differently (tokenizer, vocab, dtype: {items[0][1]} vs {got}); "
                             "prepare them with one tokenizer")


def _loader(cfg, mixture, segments, name: str, shuffle: bool, process_index: int, process_count: int):
    t = cfg.train
    common = dict(seq_len=t.seq_len, global_batch=t.global_batch, vocab_size=cfg.model.vocab_size,
                  process_index=process_index, process_count=process_count, shuffle=shuffle)
    if len(mixture) == 1:
        return TokenLoader(segments[0], seed=cfg.seed, name=f"{name} ({cfg.data.source})", **common)
    loaders = [TokenLoader(seg, seed=(cfg.seed, k), name=f"{name} ({cfg.data.source} {path})", **common)
               for k, ((_, path, _), seg) in enumerate(zip(mixture, segments))]
    return MixtureLoader(loaders, [w for _, _, w in mixture], [n for n, _, _ in mixture], seed=cfg.seed,
                         global_batch=t.global_batch, process_index=process_index, process_count=process_count)


def build_loaders(cfg, process_index: int = 0, process_count: int = 1):
    """(train loader, eval loader, tokenizer) for a run config. `data.path` (and `data.eval_path`) may
    name a weighted mixture of sources (see `parse_mixture`); without `data.eval_path` the last
    `data.eval_fraction` of every source is held out and mixed with the same weights."""
    d = cfg.data
    tok = load_tokenizer(d.tokenizer)
    if d.tokenizer not in ("", "byte") and tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"config field `model.vocab_size`: {cfg.model.vocab_size} is smaller than the "
                         f"tokenizer's {tok.vocab_size}; set --config.model.vocab_size={tok.vocab_size}")
    mixture = [("embedded", "", 1.0)] if d.source == "embedded" else parse_mixture(d.path, "data.path")
    _check_mixture(cfg, mixture, "data.path")
    sources = [_tokens(d.source, path, cfg, tok, "data.path") for _, path, _ in mixture]
    if d.eval_path:
        eval_mixture = parse_mixture(d.eval_path, "data.eval_path")
        _check_mixture(cfg, eval_mixture, "data.eval_path")
        train, held = sources, [_tokens(d.source, path, cfg, tok, "data.eval_path") for _, path, _ in eval_mixture]
    else:
        eval_mixture = mixture
        train, held = zip(*[_split_tail(s, d.eval_fraction) for s in sources])
    return (_loader(cfg, mixture, train, "train data", True, process_index, process_count),
            _loader(cfg, eval_mixture, held, "eval data", False, process_index, process_count), tok)
