"""Reading `data.prepare`'s inputs (in the workers): each file's format, the byte ranges a large
JSONL file is cut into, and the documents of one range as text, with one-line errors naming the
file and line."""

from __future__ import annotations

import gzip
import io
import json

from boost_jax.data.shard_dir import error_reason
from boost_jax.errors import PrepareError

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
TEXT_CHUNK = 8 << 20  # a text file is tokenised in pieces of this many bytes, cut at line ends


def file_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path[:-4] if path.endswith(".zst") else path
    if name.endswith((".jsonl", ".json")):
        return JSONL
    return PARQUET if name.endswith(".parquet") else TEXT


def splittable(path: str) -> bool:
    """Only uncompressed JSONL is cut into ranges (at line starts): a text file is one document."""
    return file_format(path) == JSONL and not path.endswith((".gz", ".zst"))


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise PrepareError(f"{path}: reading .zst needs zstandard: pip install zstandard") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def _lines(f, start: int, end: int):
    """(offset, line) for the lines that start in [start, end): each line belongs to one range."""
    if start:
        f.seek(start - 1)
        f.readline()  # the rest of a line that began in the previous range
    pos = f.tell() if start else 0
    while pos < end:
        line = f.readline()
        if not line:
            return
        yield pos, line
        pos += len(line)


def _line_of(path: str, pos: int) -> str:
    """PATH:LINE of the line starting at byte `pos` of the (decompressed) file; for error messages."""
    newlines, done = 0, 0
    with _open(path) as f:
        while done < pos:
            chunk = f.read(min(1 << 20, pos - done))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            done += len(chunk)
    return f"{path}:{newlines + 1}"


def _documents(path: str, start: int, end: int, field: str):
    """(text, ends_document) pieces of one byte range; text None only marks a document's end."""
    fmt = file_format(path)
    if fmt == PARQUET:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
        parquet = pq.ParquetFile(path)
        if field not in parquet.schema_arrow.names:
            raise PrepareError(
                f"{path}: no column {field!r} (columns: {parquet.schema_arrow.names}); set --field (data.jsonl_field)"
            )
        for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield str(text), True
        return
    with _open(path) as f:
        if fmt == JSONL:
            for pos, line in _lines(f, start, end if splittable(path) else float("inf")):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except UnicodeDecodeError as e:
                    raise PrepareError(
                        f"{_line_of(path, pos)}: not valid UTF-8 (byte {e.start} of the line); "
                        "re-encode the file as UTF-8"
                    ) from None
                except ValueError as e:
                    raise PrepareError(
                        f"{_line_of(path, pos)}: not JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')})"
                    ) from None
                if not isinstance(record, dict):
                    raise PrepareError(
                        f"{_line_of(path, pos)}: a JSON {type(record).__name__}, not an object with a {field!r} field"
                    )
                if field not in record:
                    raise PrepareError(
                        f"{_line_of(path, pos)}: no field {field!r} (its fields: "
                        f"{sorted(record)[:6]}); set data.jsonl_field (prepare: --field)"
                    )
                text = record[field]
                if not isinstance(text, str):
                    raise PrepareError(
                        f"{_line_of(path, pos)}: field {field!r} is not a string but {type(text).__name__}"
                    )
                yield text, True
            return
        piece, piece_start = [], 0  # the whole file, in pieces of whole lines that bound the memory
        for pos, line in _lines(f, 0, float("inf")):
            if not piece:
                piece_start = pos
            piece.append(line)
            if pos + len(line) - piece_start >= TEXT_CHUNK:
                yield _decode(b"".join(piece), path, piece_start), False
                piece = []
        yield (_decode(b"".join(piece), path, piece_start) if piece else None), True


def read_documents(path: str, start: int, end: int, field: str):
    """_documents, with an unreadable input (I/O error, corrupt .gz) as a one-line error naming it."""
    try:
        yield from _documents(path, start, end, field)
    except (OSError, EOFError) as e:
        raise PrepareError(f"{path}: cannot read it ({error_reason(e)}); fix or replace that input") from None


def _decode(data: bytes, path: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = offset + e.start
        raise PrepareError(
            f"{_line_of(path, at)}: not valid UTF-8 (byte {at} of the file); re-encode the file as UTF-8"
        ) from None
