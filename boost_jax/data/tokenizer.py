"""Tokenizers: bytes (no files needed), or a local HF `tokenizers` JSON / SentencePiece model."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from boost_jax.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255: needs no vocabulary file and covers any text."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # optional dependency
            raise ImportError("data.tokenizer points at a tokenizers JSON: `pip install tokenizers`") from e
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next(
            (
                self._tok.token_to_id(t)
                for t in ("</s>", "<|endoftext|>", "<eos>")
                if self._tok.token_to_id(t) is not None
            ),
            None,
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class SentencePieceTokenizer:
    def __init__(self, path: str):
        try:
            import sentencepiece as spm
        except ImportError as e:  # optional dependency
            raise ImportError("data.tokenizer points at a SentencePiece model: `pip install sentencepiece`") from e
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


def _other_json(path: str) -> str | None:
    """What a JSON file that is not a tokenizers JSON holds instead (None: not JSON, or a tokenizer's
    JSON that does not load, so damaged)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}"
    if isinstance(data.get("model"), dict):
        return None
    keys = ", ".join(list(data)[:5]) + (", ..." if len(data) > 5 else "")
    return f'an object with the keys {keys}, no "model" entry' if data else "an empty object"


def load_tokenizer(spec: str, field: str = "config field `data.tokenizer`"):
    """'byte' (or ""), a HF tokenizers .json or a SentencePiece model, loaded and checked once: a file
    that does not load (a truncated download, a corrupt model) is a ConfigError naming `field` and it."""
    if spec in ("", "byte"):
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise FileNotFoundError(
            f"{field}: no file at {spec!r}; give a tokenizers .json, a SentencePiece .model, or 'byte'"
        )
    kind = "tokenizers JSON" if spec.endswith(".json") else "SentencePiece model"
    try:
        tok = HFTokenizer(spec) if spec.endswith(".json") else SentencePieceTokenizer(spec)
        if tok.vocab_size < 1:
            raise ValueError("an empty vocabulary")
        tok.decode(tok.encode("a"))
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - the Rust and C++ libraries raise plain Exception/RuntimeError
        why = " ".join(str(e).split())[:200] or type(e).__name__
        other = _other_json(spec) if spec.endswith(".json") else None
        if other:
            raise ConfigError(
                f"{field}: {spec} is valid JSON but not a tokenizer file ({other}); give the tokenizer.json "
                'that HF `tokenizers` saves (an object with a "model" entry), a SentencePiece .model, or "byte"'
            ) from None
        raise ConfigError(
            f"{field}: {spec} is not a readable {kind} ({why}); it may be truncated or damaged: "
            "copy or download it again"
        ) from None
    return tok


def tokenizer_id(spec: str) -> str:
    """'byte', or the name and content hash of a tokenizer file (paths differ between machines)."""
    if spec in ("", "byte"):
        return "byte"
    digest = hashlib.sha256(Path(spec).read_bytes()).hexdigest()[:16]
    return f"{Path(spec).name}:sha256:{digest}"
