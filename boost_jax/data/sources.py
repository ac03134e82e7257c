"""Where tokens come from: the embedded corpus, text / JSONL files, or pre-tokenized token files."""
from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

import numpy as np


def embedded_corpus(max_bytes: int) -> bytes:
    """Python's own standard-library sources: present on every machine that runs us, no download.

    Files are taken in sorted order (deterministic for one Python version), skipping tests and
    installed third-party packages, until `max_bytes` are read.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idle_test", "encodings") for p in rel):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"embedded corpus: no Python sources under {root}; "
                                "use --config.data.source=text --config.data.path=...")
    return b"\n\n".join(parts)[:max_bytes]


def expand_paths(spec: str, field: str, suffixes: tuple[str, ...]) -> list[str]:
    """A file, a directory (its files with `suffixes`, sorted) or a glob; errors name the field."""
    if os.path.isdir(spec):
        paths = sorted(str(p) for p in Path(spec).rglob("*") if p.is_file() and p.name.endswith(suffixes))
    elif any(ch in spec for ch in "*?["):
        paths = sorted(glob.glob(spec))
    else:
        paths = [spec] if os.path.exists(spec) else []
    if not paths:
        raise FileNotFoundError(f"config field `{field}`: nothing found at {spec!r} "
                                f"(expected a file, a directory of {'/'.join(suffixes)} files, or a glob)")
    empty = [p for p in paths if os.path.getsize(p) == 0]
    if empty:
        raise ValueError(f"config field `{field}`: empty file(s): {empty[:3]}")
    return paths


def _jsonl_texts(path: str, field: str):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid UTF-8 (byte {e.start} of the line); "
                                 "re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: a JSON {type(record).__name__}, not an object with a "
                                 f"{field!r} field")
            if field not in record:
                raise ValueError(f"{path}:{n}: no field {field!r} (its fields: {sorted(record)[:6]}); "
                                 "set data.jsonl_field")
            if not isinstance(record[field], str):
                raise ValueError(f"{path}:{n}: field {field!r} is not a string but {type(record[field]).__name__}")
            yield record[field]


def read_texts(paths: list[str], jsonl_field: str) -> list[str]:
    """The documents of text and JSONL files; malformed input is an error naming the file and line."""
    texts = []
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            texts.extend(_jsonl_texts(path, jsonl_field))
            continue
        raw = Path(path).read_bytes()
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {e.start} of the file); "
                             "re-encode the file as UTF-8") from None
    return texts


def token_files(paths: list[str], dtype: str) -> list[np.ndarray]:
    """Memory-mapped token files: raw .bin arrays of `dtype` (as common preprocessing scripts write)
    or 1-D integer .npy arrays; nothing is read into memory until a batch (or `check_vocab`) touches it."""
    arrays = []
    for path in paths:
        if path.endswith(".npy"):
            a = np.load(path, mmap_mode="r")
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"{path}: a {a.ndim}-D {a.dtype} array; token files must be 1-D integer arrays "
                                 "(np.save(path, tokens.ravel().astype(np.uint32)))")
            arrays.append(a)
        else:
            size, width = os.path.getsize(path), np.dtype(dtype).itemsize
            if size % width:
                raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} tokens ({width} bytes "
                                 "each); check data.token_dtype or the file's end")
            arrays.append(np.memmap(path, dtype=np.dtype(dtype), mode="r"))
    return arrays


def check_vocab(arrays: list[np.ndarray], names: list[str], vocab_size: int, chunk: int = 1 << 24) -> None:
    """Every token id in [0, vocab_size), checked before training (in chunks, so a memory-mapped file is
    streamed once) instead of failing at the batch that happens to hold a bad id."""
    for a, name in zip(arrays, names):
        info = np.iinfo(a.dtype)
        if info.min >= 0 and info.max < vocab_size:
            continue  # this dtype cannot hold a bad id
        for lo in range(0, len(a), chunk):
            part = np.asarray(a[lo:lo + chunk])
            bad = np.flatnonzero((part >= vocab_size) | (part < 0))
            if len(bad):
                i = lo + int(bad[0])
                raise ValueError(f"{name}: token {i} is {int(a[i])}, outside [0, model.vocab_size={vocab_size}); "
                                 "the data was tokenized for a larger vocabulary: raise model.vocab_size or "
                                 "check data.token_dtype")
