"""Data: sources -> token arrays -> a stateless, resumable, process-sharded batch loader."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from boost_jax.data.loader import TokenLoader
from boost_jax.data.sources import embedded_corpus, expand_paths, prepared_index, prepared_shards, token_files
from boost_jax.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["TokenLoader", "build_loaders", "load_tokenizer", "ByteTokenizer"]


def _tokens(source: str, path: str, cfg, tok, field: str) -> list[np.ndarray]:
    d = cfg.data
    if source == "embedded":
        return [np.frombuffer(embedded_corpus(d.embedded_max_bytes), dtype=np.uint8)]
    check = dict(tokenizer=d.tokenizer, vocab_size=cfg.model.vocab_size)
    if source == "tokens":
        index = prepared_index(path)
        if index is not None:
            return prepared_shards(index, field, token_dtype=d.token_dtype, **check)
        return token_files(expand_paths(path, field, (".bin", ".npy")), d.token_dtype)
    suffixes = (".jsonl", ".json") if source == "jsonl" else (".txt", ".md", ".text")
    cache = _token_cache(expand_paths(path, field, suffixes), cfg)
    return prepared_shards(cache / "index.json", field, token_dtype=None, **check)


def _token_cache(paths: list[str], cfg) -> Path:
    """Text and JSONL inputs are tokenised once, into shards under RUN_DIR/token_cache/KEY (KEY: the
    tokenizer, the JSONL field and every input's path, size and mtime), by the first process only;
    later starts and the other processes memory-map them."""
    import jax

    from boost_jax.data.prepare import INDEX, prepare, tokenizer_id  # lazily: `python -m` runs that module

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


def build_loaders(cfg, process_index: int = 0, process_count: int = 1):
    """(train loader, eval loader, tokenizer) for a run config."""
    d, t = cfg.data, cfg.train
    tok = load_tokenizer(d.tokenizer)
    if d.tokenizer not in ("", "byte") and tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"config field `model.vocab_size`: {cfg.model.vocab_size} is smaller than the "
                         f"tokenizer's {tok.vocab_size}; set --config.model.vocab_size={tok.vocab_size}")
    segments = _tokens(d.source, d.path, cfg, tok, "data.path")
    if d.eval_path:
        train, held = segments, _tokens(d.source, d.eval_path, cfg, tok, "data.eval_path")
    else:
        train, held = _split_tail(segments, d.eval_fraction)
    common = dict(seq_len=t.seq_len, seed=cfg.seed, vocab_size=cfg.model.vocab_size,
                  process_index=process_index, process_count=process_count)
    train_loader = TokenLoader(train, global_batch=t.global_batch, name=f"train data ({d.source})", **common)
    eval_loader = TokenLoader(held, global_batch=t.global_batch, name=f"eval data ({d.source})",
                              shuffle=False, **common)
    return train_loader, eval_loader, tok
