"""Faults and bad inputs at the edges: imports and exports that never overwrite a run or a model,
verified document indexes and tokenizer files, data with nothing to learn from, full disks and
read-only mounts, killed jobs, preemption during evaluation. Each test injects the fault and checks
the one-line message, the exit status and what is on disk."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boost_jax import train
from boost_jax.errors import ConfigError
from conftest import small_config

ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(root: Path) -> dict:
    """{relative path: bytes} of every file under root (what "nothing on disk was lost" compares)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- import and export never overwrite

def hf_model(tmp_path, name="hf", seed=0, tokenizer: bytes | None = None):
    """A HF Llama dir (config.json, model.safetensors, optionally tokenizer.json) of the small model,
    written from a freshly initialised model (no training needed)."""
    pytest.importorskip("safetensors")
    from flax import nnx
    from safetensors.numpy import save_file

    from boost_jax import export
    from boost_jax.model.transformer import build_model
    m = small_config(tmp_path / "unused", **{"model.linear": "dense"}).model
    d = tmp_path / name
    d.mkdir()
    save_file(export.to_hf(nnx.to_pure_dict(nnx.state(build_model(m, seed=seed))), m), str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(export.hf_config(m)))
    if tokenizer is not None:
        (d / "tokenizer.json").write_bytes(tokenizer)
    return d


def test_import_never_writes_into_a_run(tmp_path, capsys):
    """--import-hf into a dir holding a run is refused (the run's steps untouched), the same import
    twice says what exists, and --supersede moves the old steps aside: the newest step is the import's."""
    from boost_jax import export
    from boost_jax.runtime.checkpoint import read_run
    first, second = hf_model(tmp_path, "a", seed=1), hf_model(tmp_path, "b", seed=2)
    run = tmp_path / "run"
    assert export.main(["--import-hf", str(first), "--out", str(run)]) == 0
    capsys.readouterr()
    before = tree_bytes(run / "checkpoints")
    for source in (first, second):  # the same import again, and another model
        assert export.main(["--import-hf", str(source), "--out", str(run)]) == 1
        err = one_error_line(capsys.readouterr().err)
        assert f"--out: {run} already holds a run with checkpoints (steps [0])" in err and "--supersede" in err, err
        assert "Fix the cause" not in err
        assert tree_bytes(run / "checkpoints") == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert export.main(["--import-hf", str(first), "--out", str(tmp_path / "other")]) == 1
    assert "already holds files (notes.txt)" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]

    assert export.main(["--import-hf", str(second), "--out", str(run), "--supersede"]) == 0
    out = capsys.readouterr().out
    assert "0.superseded" in out
    moved = tree_bytes(run / "checkpoints" / "0.superseded")
    assert moved == {k[len("0/"):]: v for k, v in before.items() if k.startswith("0/")}  # kept byte for byte
    assert read_run(str(run))[2] == 0
    from boost_jax.runtime.build import load_model
    from safetensors.numpy import load_file
    embed = np.asarray(load_model(str(run))[0].embed[...])
    np.testing.assert_array_equal(embed, load_file(str(second / "model.safetensors"))["model.embed_tokens.weight"])


def test_export_refuses_another_models_files_and_writes_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """A stale tokenizer beside the new model is refused (or moved aside with --supersede); a full disk
    or a read-only mount is one line and leaves the earlier export byte for byte."""
    import safetensors.numpy as stn

    from boost_jax import export
    run = tmp_path / "run"
    assert export.main(["--import-hf", str(hf_model(tmp_path)), "--out", str(run)]) == 0  # byte tokenizer
    hf = tmp_path / "out"
    hf.mkdir()
    (hf / "tokenizer.json").write_text('{"another": "model"}')
    assert export.main(["--checkpoint", str(run), "--out", str(hf)]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert "does not write (tokenizer.json)" in err and "--supersede" in err, err
    assert sorted(p.name for p in hf.iterdir()) == ["tokenizer.json"]
    assert export.main(["--checkpoint", str(run), "--out", str(hf), "--supersede"]) == 0
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json.superseded"]
    assert (hf / "tokenizer.json.superseded").read_text() == '{"another": "model"}'
    before = tree_bytes(hf)

    real = stn.save_file
    for code in (errno.ENOSPC, errno.EROFS):
        def failing(tensors, path, metadata=None, code=code):
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:  # half written when the disk filled up
                f.truncate(os.path.getsize(path) // 2)
            raise OSError(code, os.strerror(code), path)

        monkeypatch.setattr(stn, "save_file", failing)
        assert export.main(["--checkpoint", str(run), "--out", str(hf)]) == 1
        err = one_error_line(capsys.readouterr().err)
        assert f"--out: cannot write {hf}/model.safetensors" in err and errno.errorcode[code] in err, err
        assert "nothing in" in err and tree_bytes(hf) == before


def test_import_on_a_full_disk_is_one_line_and_leaves_no_partial_step(tmp_path, capfd, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    from boost_jax import export
    rename = async_path.rename

    async def disk_full(src, dst):
        if Path(dst).name == "0":
            raise OSError(errno.ENOSPC, "No space left on device")
        return await rename(src, dst)

    monkeypatch.setattr(async_path, "rename", disk_full)
    run = tmp_path / "run"
    assert export.main(["--import-hf", str(hf_model(tmp_path)), "--out", str(run)]) == 1
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: saving step 0 failed") and "No space left" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []  # no 0.orbax-checkpoint-tmp
    monkeypatch.undo()
    assert export.main(["--import-hf", str(hf_model(tmp_path, "again")), "--out", str(run)]) == 0  # rerun works


# ---------------------------------------------------------------- tokenizer files are loaded once, up front

@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """(a valid tokenizers JSON, a truncated copy of it, a valid SentencePiece model, a corrupt one)."""
    tokenizers = pytest.importorskip("tokenizers")
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("tok")
    lines = [f"def function_{i}(value):\n    return value * {i}\n" for i in range(300)]
    (d / "corpus.txt").write_text("".join(lines))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "</s>"]))
    tok.save(str(d / "tok.json"))
    text = (d / "tok.json").read_bytes()
    (d / "cut.json").write_bytes(text[: len(text) // 2])  # an interrupted download
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=120,
                                   model_type="bpe", minloglevel=2)
    raw = bytearray((d / "sp.model").read_bytes())
    (d / "bad.model").write_bytes(bytes(raw[: len(raw) // 3]) + os.urandom(64))
    return d / "tok.json", d / "cut.json", d / "sp.model", d / "bad.model"


@pytest.mark.parametrize("which", [1, 3], ids=["truncated-json", "corrupt-sentencepiece"])
def test_damaged_tokenizer_is_one_line_naming_it(tokenizer_files, make_config, tmp_path, capsys, which):
    from boost_jax.data import build_loaders
    from boost_jax.data import prepare
    bad = tokenizer_files[which]
    (tmp_path / "c.txt").write_text("hello world\n" * 50)
    with pytest.raises(ConfigError, match=rf"config field `data\.tokenizer`: {bad} is not a readable"):
        build_loaders(make_config(**{"data.source": "text", "data.path": str(tmp_path / "c.txt"),
                                     "data.tokenizer": str(bad), "model.vocab_size": 512}))
    assert prepare.main([str(tmp_path / "c.txt"), "--out", str(tmp_path / "p"), "--tokenizer", str(bad),
                         "--workers", "0", "--no-progress"]) == 1
    assert f"--tokenizer: {bad} is not a readable" in one_error_line(capsys.readouterr().err)
    # The intact file of the same kind loads (the check refuses only the damage).
    good = tokenizer_files[which - 1]
    assert prepare.main([str(tmp_path / "c.txt"), "--out", str(tmp_path / "q"), "--tokenizer", str(good),
                         "--workers", "0", "--no-progress"]) == 0


def test_import_checks_the_tokenizer_before_copying_it(tokenizer_files, tmp_path, capsys):
    from boost_jax import export
    hf = hf_model(tmp_path, tokenizer=tokenizer_files[1].read_bytes())
    assert export.main(["--import-hf", str(hf), "--out", str(tmp_path / "run")]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert f"{hf}/tokenizer.json is not a readable tokenizers JSON" in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- prepared indexes are verified when opened

@pytest.fixture
def prepared(tmp_path):
    """A prepared dir (byte tokenizer, documents of random lengths, two shards) and a config reading it
    with document batching."""
    from boost_jax.data.prepare import prepare
    rng = np.random.default_rng(3)
    for k in range(2):
        with open(tmp_path / f"{k}.jsonl", "w") as f:
            for _ in range(60):
                f.write(json.dumps({"text": "x" * int(rng.integers(5, 40))}) + "\n")
    prepare([str(tmp_path / "0.jsonl"), str(tmp_path / "1.jsonl")], tmp_path / "p", unit_bytes=1500,
            progress=False)
    cfg = small_config(tmp_path / "run", **{"data.source": "tokens", "data.path": str(tmp_path / "p"),
                                            "data.batching": "document", "data.token_dtype": "uint16"})
    return tmp_path / "p", cfg


@pytest.mark.parametrize("damage, needle", [
    (lambda e: e.__setitem__([7, 8], e[[8, 7]]), r"entry 8 \(the end of document 8\) is \d+, below the previous end"),
    (lambda e: e.__setitem__(3, e[-1] + 10), r"entry 3 \(the end of document 3\) is \d+, beyond the shard's \d+ tokens"),
    (lambda e: e.__setitem__(0, -5), r"entry 0 \(the end of document 0\) is -5, negative"),
], ids=["swapped", "beyond", "negative"])
def test_damaged_document_index_names_file_and_entry(prepared, damage, needle):
    from boost_jax.data import build_loaders
    out, cfg = prepared
    build_loaders(cfg)  # intact: loads
    idx = out / "shard_00001.idx"
    ends = np.fromfile(idx, np.int64)
    assert len(ends) > 10 and np.all(np.diff(ends) > 0)
    damage(ends)
    ends.tofile(idx)
    with pytest.raises(ValueError, match=rf"{idx}: " + needle) as e:
        build_loaders(cfg)
    assert f"prepare {out} again" in str(e.value)


@pytest.mark.parametrize("damage, needle", [
    (lambda t: t[: len(t) // 2], r"index\.json is not readable JSON \(.*\); it may be truncated"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "shards"}),
     r"index\.json lacks the field\(s\) \['shards'\]"),
    (lambda t: json.dumps({**json.loads(t), "shards": [{"file": "shard_00000.bin"}]}),
     r"index\.json: shards\[0\] has no valid 'tokens'"),
], ids=["truncated", "no-shards", "shard-without-tokens"])
def test_damaged_index_json_names_the_file(prepared, damage, needle):
    from boost_jax.data import build_loaders
    import shutil
    out, cfg = prepared
    shutil.copytree(out, out.with_name("intact"))
    (out / "index.json").write_text(damage((out / "index.json").read_text()))
    with pytest.raises(ValueError, match=rf"config field `data\.path`: {out}/" + needle):
        build_loaders(cfg)
    cfg.data.path = f"{out.with_name('intact')}:1,{out}:1"  # the mixture check reads it first: same message
    with pytest.raises(ValueError, match=rf"{out}/" + needle):
        build_loaders(cfg)
