"""Where tokens come from: the embedded corpus, text / JSONL files, or pre-tokenized token files."""

from __future__ import annotations

import glob
import json
import math
import mmap
import os
import sysconfig
from pathlib import Path

import numpy as np

from boost_jax.data.loader import MIX_BLOCK
from boost_jax.data.mapped import watch
from boost_jax.data.tokenizer import tokenizer_id

INDEX = "index.json"  # what boost_jax.data.prepare writes beside its shards
FORMAT = "boost_jax.tokens/1"


def embedded_corpus(max_bytes: int) -> bytes:
    """Python's own standard-library sources: present on every machine that runs us, no download."""
    return embedded_documents(max_bytes)[0]


def embedded_documents(max_bytes: int) -> tuple[bytes, np.ndarray]:
    """(the embedded corpus, the end offset of each document in it): one document per source file.

    Files are taken in sorted order (deterministic for one Python version), skipping tests and
    installed third-party packages, until `max_bytes` are read; they are joined by a blank line,
    which ends each document.
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
        raise FileNotFoundError(
            f"embedded corpus: no Python sources under {root}; use --config.data.source=text --config.data.path=..."
        )
    corpus = b"\n\n".join(parts)[:max_bytes]
    ends = np.minimum(np.cumsum([len(p) + 2 for p in parts]), len(corpus))
    return corpus, np.unique(ends[ends > 0])


def parse_mixture(spec: str, field: str) -> list[tuple[str, str, float]]:
    """`PATH[:WEIGHT][,PATH[:WEIGHT]...]` -> [(name, path, weight)], weights normalised to sum to 1.

    A part without a weight weighs 1; NAME (for the per-source metrics) is the last plain component
    of the path, without suffix. Errors name the field.
    """
    syntax = f"write PATH[:WEIGHT][,PATH[:WEIGHT]...], e.g. --config.{field}=/data/c4:0.7,/data/code:0.3"
    parts = []
    for part in spec.split(","):
        path, sep, tail = part.strip().rpartition(":")
        try:
            weight = float(tail) if sep else 1.0
        except ValueError:  # a ':' that belongs to the path
            path, weight = part.strip(), 1.0
        path = path if sep else tail
        if not path:
            raise ValueError(f"config field `{field}`: {spec!r} has an empty source; {syntax}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"config field `{field}`: the weight of {path!r} is {tail}; weights must be positive")
        parts.append((path, weight))
    seen: dict[str, str] = {}
    for path, _ in parts:  # compared resolved: `c.jsonl` and `./c.jsonl`, a prepared dir and its index.json
        key = _same_source_key(path)
        if key in seen:
            same = "twice" if seen[key] == path else f"twice ({seen[key]!r} and {path!r} are the same)"
            raise ValueError(
                f"config field `{field}`: {spec!r} names a source {same}; give it once with one summed weight"
            )
        seen[key] = path
    total = sum(w for _, w in parts)
    small = [p for p, w in parts if w / total < 1 / MIX_BLOCK]
    if small:
        raise ValueError(f"config field `{field}`: the weight of {small[0]!r} is below 1/{MIX_BLOCK} of the total")
    names: list[str] = []
    for path, _ in parts:
        plain = [c for c in Path(path).parts if c not in ("/", ".", "..") and not any(ch in c for ch in "*?[")]
        if plain and plain[-1] == "index.json":
            plain.pop()
        name = plain[-1].split(".")[0] if plain else ""
        name = name or "data"
        names.append(name if name not in names else f"{name}_{len(names) + 1}")
    return [(n, p, w / total) for n, (p, w) in zip(names, parts)]


def _same_source_key(path: str) -> str:
    """What a mixture entry reads, for finding one given twice: the resolved path (a prepared dir for
    its index.json); a glob stays as written."""
    if any(ch in path for ch in "*?["):
        return path
    p = Path(path).expanduser().resolve()
    return str(p.parent if p.name == INDEX and (p.parent / "plan.json").exists() else p)


def expand_paths(spec: str, field: str, suffixes: tuple[str, ...]) -> list[str]:
    """A file, a directory (its files with `suffixes`, sorted) or a glob; errors name the field."""
    if os.path.isdir(spec):
        paths = sorted(str(p) for p in Path(spec).rglob("*") if p.is_file() and p.name.endswith(suffixes))
    elif any(ch in spec for ch in "*?["):
        paths = sorted(glob.glob(spec))
    else:
        paths = [spec] if os.path.exists(spec) else []
    if not paths:
        raise FileNotFoundError(
            f"config field `{field}`: nothing found at {spec!r} "
            f"(expected a file, a directory of {'/'.join(suffixes)} files, or a glob)"
        )
    empty = [p for p in paths if os.path.getsize(p) == 0]
    if empty:
        raise ValueError(f"config field `{field}`: empty file(s): {empty[:3]}")
    return paths


def prepared_index(spec: str) -> Path | None:
    """The index.json of a `python -m boost_jax.data.prepare` directory named by spec, if it is one."""
    path = Path(spec)
    if path.name == "index.json" and path.is_file():
        return path
    if path.is_dir() and (path / "plan.json").exists():
        if not (path / "index.json").exists():
            raise ValueError(
                f"{path}: an unfinished `python -m boost_jax.data.prepare` (no index.json); "
                "rerun the same command to finish it"
            )
        return path / "index.json"
    return None


def prepared_shards(
    index_path: Path, field: str, *, tokenizer: str, vocab_size: int, token_dtype: str | None, tok_id: str | None = None
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """(the memory-mapped shards of a prepared directory, each shard's document end offsets or None
    when the directory records no document boundaries), after checking that the run reads them as
    they were written: dtype, vocabulary and tokenizer (`tok_id`: its identity, if known already);
    every error names the field to change."""
    index = read_index(index_path, field)
    where = index_path.parent
    if token_dtype is not None and index["dtype"] != token_dtype:
        raise ValueError(
            f"config field `data.token_dtype`: {token_dtype}, but {where} holds {index['dtype']} "
            f"tokens; set --config.data.token_dtype={index['dtype']}"
        )
    if index["vocab_size"] > vocab_size:
        raise ValueError(
            f"config field `model.vocab_size`: {vocab_size} is smaller than the vocabulary "
            f"({index['vocab_size']}) that {where} was tokenised with; set "
            f"--config.model.vocab_size={index['vocab_size']}"
        )
    if (tok_id or tokenizer_id(tokenizer)) != index["tokenizer_id"]:
        raise ValueError(
            f"config field `data.tokenizer`: {tokenizer!r} is not the tokenizer {where} was made "
            f"with ({index['tokenizer']}, {index['tokenizer_id']}); point data.tokenizer at it"
        )
    arrays, ends = [], []
    documented = all("ends" in shard for shard in index["shards"])
    for shard in index["shards"]:
        path = where / shard["file"]
        size = path.stat().st_size if path.exists() else -1
        if size != shard["tokens"] * np.dtype(index["dtype"]).itemsize:
            raise ValueError(
                f"{path}: {'missing' if size < 0 else f'{size} bytes'}, the index says "
                f"{shard['tokens']} {index['dtype']} tokens; prepare {where} again"
            )
        if shard["tokens"]:
            arrays.append(watch(random_access(np.memmap(path, dtype=np.dtype(index["dtype"]), mode="r")), path))
            if documented:
                ends.append(_document_ends(where, shard))
    return arrays, (ends if documented else None)


INDEX_FIELDS = ("dtype", "vocab_size", "tokenizer", "tokenizer_id", "shards")
SHARD_FIELDS = {"file": str, "tokens": int}


def read_index(index_path: Path, field: str) -> dict:
    """A prepared directory's index.json, checked for the fields the loader reads: unreadable JSON (a
    truncated copy) or a missing field is a ValueError naming the file, not a KeyError later."""
    redo = f"prepare {index_path.parent} again (or copy it whole)"
    try:
        index = json.loads(Path(index_path).read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise ValueError(
            f"config field `{field}`: {index_path} is not readable JSON ({why}); it may be truncated: {redo}"
        ) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"config field `{field}`: {index_path} is not a {FORMAT} index")
    missing = [k for k in INDEX_FIELDS if k not in index]
    if missing or not isinstance(index["shards"], list):
        raise ValueError(
            f"config field `{field}`: {index_path} lacks the field(s) {missing or ['shards (a list)']}; {redo}"
        )
    for k, shard in enumerate(index["shards"]):
        wrong = [
            f
            for f, kind in SHARD_FIELDS.items()
            if not isinstance(shard, dict) or not isinstance(shard.get(f), kind) or isinstance(shard.get(f), bool)
        ]
        if wrong or shard["tokens"] < 0:
            raise ValueError(
                f"config field `{field}`: {index_path}: shards[{k}] has no valid {(wrong or ['tokens'])[0]!r}; {redo}"
            )
    return index


def check_ends(ends: np.ndarray, tokens: int, path: Path, where: Path) -> None:
    """Document end offsets rise (never fall) from >= 0 to the shard's token count: checked in one
    vectorised pass, the first bad entry named (a bad index would read rows outside the shard)."""
    e = np.asarray(ends, np.int64)
    if not len(e):
        return
    bad = (e < 0) | (e > tokens)
    bad[1:] |= e[1:] < e[:-1]
    if bad.any():
        i = int(np.argmax(bad))
        v = int(e[i])
        why = (
            "negative"
            if v < 0
            else f"beyond the shard's {tokens} tokens"
            if v > tokens
            else f"below the previous end {int(e[i - 1])}"
        )
        raise ValueError(
            f"{path}: entry {i} (the end of document {i}) is {v}, {why}; document ends must rise "
            f"from 0 to {tokens}: the file is damaged; prepare {where} again"
        )
    if int(e[-1]) != tokens:
        raise ValueError(
            f"{path}: its last document ends at token {int(e[-1])}, the shard holds {tokens}; prepare {where} again"
        )


def _document_ends(where: Path, shard: dict) -> np.ndarray:
    """A shard's document end offsets (int64, one per document, the last = the shard's tokens),
    memory-mapped from the `.idx` file data.prepare writes beside it."""
    docs = shard.get("documents")
    if not isinstance(shard["ends"], str) or not isinstance(docs, int) or isinstance(docs, bool) or docs < 0:
        raise ValueError(
            f"{where / INDEX}: shard {shard['file']} has no valid 'ends' and 'documents'; prepare {where} again"
        )
    path = where / shard["ends"]
    size = path.stat().st_size if path.exists() else -1
    if size != 8 * shard["documents"]:
        raise ValueError(
            f"{path}: {'missing' if size < 0 else f'{size} bytes'}, the index says "
            f"{shard['documents']} documents; prepare {where} again"
        )
    ends = watch(np.memmap(path, dtype=np.int64, mode="r"), path) if size else np.zeros(0, np.int64)
    check_ends(ends, shard["tokens"], path, where)
    return ends


def random_access(array: np.memmap) -> np.memmap:
    """Tell the kernel the mapping is read at random (a shuffled sample at a time): without it each
    first touch of a page may read ahead up to the block device's read_ahead_kb (megabytes)."""
    mm = getattr(array, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_RANDOM"):
        try:
            mm.madvise(mmap.MADV_RANDOM)
        except (OSError, ValueError):
            pass
    return array


def token_files(paths: list[str], dtype: str) -> list[np.ndarray]:
    """Memory-mapped token files: raw .bin arrays of `dtype` (as common preprocessing scripts write)
    or 1-D integer .npy arrays; nothing is read into memory until a batch (or `check_vocab`) touches it."""
    arrays = []
    for path in paths:
        if path.endswith(".npy"):
            a = watch(np.load(path, mmap_mode="r"), path)
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(
                    f"{path}: a {a.ndim}-D {a.dtype} array; token files must be 1-D integer arrays "
                    "(np.save(path, tokens.ravel().astype(np.uint32)))"
                )
            arrays.append(a)
        else:
            size, width = os.path.getsize(path), np.dtype(dtype).itemsize
            if size % width:
                raise ValueError(
                    f"{path}: {size} bytes is not a whole number of {dtype} tokens ({width} bytes "
                    "each); check data.token_dtype or the file's end"
                )
            arrays.append(watch(random_access(np.memmap(path, dtype=np.dtype(dtype), mode="r")), path))
    return arrays


def check_vocab(arrays: list[np.ndarray], names: list[str], vocab_size: int, chunk: int = 1 << 24) -> None:
    """Every token id in [0, vocab_size), checked before training (in chunks, so a memory-mapped file is
    streamed once) instead of failing at the batch that happens to hold a bad id."""
    for a, name in zip(arrays, names):
        info = np.iinfo(a.dtype)
        if info.min >= 0 and info.max < vocab_size:
            continue  # this dtype cannot hold a bad id
        for lo in range(0, len(a), chunk):
            part = np.asarray(a[lo : lo + chunk])
            bad = np.flatnonzero((part >= vocab_size) | (part < 0))
            if len(bad):
                i = lo + int(bad[0])
                raise ValueError(
                    f"{name}: token {i} is {int(a[i])}, outside [0, model.vocab_size={vocab_size}); "
                    "the data was tokenized for a larger vocabulary: raise model.vocab_size or "
                    "check data.token_dtype"
                )
