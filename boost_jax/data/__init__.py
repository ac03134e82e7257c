"""Data: sources -> token arrays -> a stateless, resumable, process-sharded batch loader."""
from __future__ import annotations

import numpy as np

from boost_jax.data.loader import TokenLoader
from boost_jax.data.sources import check_vocab, embedded_corpus, expand_paths, read_texts, token_files
from boost_jax.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["TokenLoader", "build_loaders", "load_tokenizer", "ByteTokenizer"]


def _encode(texts: list[str], tok) -> np.ndarray:
    ids: list[int] = []
    for t in texts:
        ids.extend(tok.encode(t))
        if tok.eos_id is not None:
            ids.append(tok.eos_id)
    return np.asarray(ids, dtype=np.uint32)


def _tokens(source: str, path: str, cfg, tok, field: str) -> list[np.ndarray]:
    d = cfg.data
    if source == "embedded":
        return [np.frombuffer(embedded_corpus(d.embedded_max_bytes), dtype=np.uint8)]
    if source == "tokens":
        paths = expand_paths(path, field, (".bin", ".npy"))
        arrays = token_files(paths, d.token_dtype)
        check_vocab(arrays, paths, cfg.model.vocab_size)
        return arrays
    suffixes = (".jsonl", ".json") if source == "jsonl" else (".txt", ".md", ".text")
    ids = _encode(read_texts(expand_paths(path, field, suffixes), d.jsonl_field), tok)
    check_vocab([ids], [f"{field} {path!r} tokenized with data.tokenizer={d.tokenizer!r}"], cfg.model.vocab_size)
    return [ids]


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
