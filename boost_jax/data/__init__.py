"""Data: sources -> token arrays -> a stateless, resumable, process-sharded batch loader.

sources.py reads files and the embedded corpus, tokenizer.py turns text into ids, prepare.py writes
token shards with their document index, pipeline.py builds a config's loaders (token cache, held-out
split, mixture), loader.py batches rows (stream | packed | document), shuffle.py orders them."""

from __future__ import annotations

from boost_jax.data.loader import DocumentLoader, MixtureLoader, PackedLoader, TokenLoader
from boost_jax.data.pipeline import CACHE_VERSION, SOURCES, build_loaders, changed_sources
from boost_jax.data.sources import parse_mixture
from boost_jax.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "SOURCES",
    "CACHE_VERSION",
    "TokenLoader",
    "DocumentLoader",
    "PackedLoader",
    "MixtureLoader",
    "build_loaders",
    "changed_sources",
    "load_tokenizer",
    "ByteTokenizer",
    "parse_mixture",
]
