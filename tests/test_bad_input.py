"""Bad input ends in a one-line error naming the field, file or line (never a traceback)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from boost_jax import train
from boost_jax.data import build_loaders
from boost_jax.errors import ConfigError
from boost_jax.validate import validate

ROOT = Path(__file__).resolve().parents[1]


def cli(module, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    return r.returncode, r.stdout, r.stderr


def test_train_cli_misspelt_key_and_missing_config_file(tmp_path):
    rc, _, err = cli("boost_jax.train", "--config.train.lrr=1", f"--config.run_dir={tmp_path}")
    assert rc == 1 and err.count("\n") == 1, err
    assert 'unknown key \'lrr\'; Did you mean "lr" instead of "lrr"?' in err
    rc, _, err = cli("boost_jax.train", f"--config={tmp_path}/nope.py")
    assert rc == 1 and err.count("\n") == 1 and "No such file or directory" in err and "nope.py" in err, err


@pytest.mark.parametrize(
    "text,needle",
    [
        ("def get_config(:\n    pass\n", r"cfg\.py:1: syntax error"),
        ("x = 1\n", r"cfg\.py has no get_config\(\)"),
        ("def get_config():\n    return {'train': {}}\n", r"returned a dict, not an ml_collections\.ConfigDict"),
        ("def get_config():\n    return 1 / 0\n", r"cfg\.py:2: ZeroDivisionError"),
    ],
    ids=["syntax", "no_get_config", "dict", "raises"],
)
def test_broken_config_files_are_one_line(tmp_path, capsys, text, needle):
    """A config file that cannot load names the file and line (the command line parses it so)."""
    import re

    (tmp_path / "cfg.py").write_text(text)
    with pytest.raises(SystemExit) as e:
        train.parse_config(["train", f"--config={tmp_path / 'cfg.py'}"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and re.search(needle, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("train.lr", float("nan"), "train.lr"),
        ("train.lr", -1e-3, "train.lr"),
        ("train.b1", 1.0, "train.b1"),
        ("train.b2", -0.1, "train.b2"),
        ("train.eps", 0.0, "train.eps"),
        ("train.weight_decay", float("inf"), "train.weight_decay"),
        ("train.nonfinite", "ignore", "train.nonfinite"),
        ("train.stop_at_step", -3, "train.stop_at_step"),
        ("train.eval_batches", 0, "train.eval_batches"),
    ],
)
def test_optimizer_and_loop_settings_are_validated(make_config, field, value, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(make_config(**{field: value}))


def test_run_dir_that_is_a_file(make_config, tmp_path):
    (tmp_path / "f").write_text("x")
    for run_dir in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(ConfigError, match=r"config field `run_dir`: cannot write to .*f"):
            train.run(make_config(run_dir=run_dir))


@pytest.mark.parametrize(
    "name,kind",
    [
        ("metrics.jsonl", "a directory, not a file"),
        ("config.json", "a directory, not a file"),
        ("checkpoints", "a file, not a directory"),
        ("tensorboard", "a file, not a directory"),
        ("token_cache", "a file, not a directory"),
    ],
)
def test_paths_the_run_writes_are_checked_before_it_compiles(make_config, tmp_path, monkeypatch, name, kind):
    """A path under run_dir that the run will write, of the wrong kind: one ConfigError naming it and
    the fix, before anything is built or compiled (not a traceback, or a failed first save, after it)."""

    def built(*args, **kwargs):
        raise AssertionError("built before the run's paths were checked")

    monkeypatch.setattr(train, "build", built)
    cfg = make_config()
    path = Path(cfg.run_dir) / name
    path.parent.mkdir(parents=True)
    path.mkdir() if kind.startswith("a directory") else path.write_text("in the way")
    with pytest.raises(ConfigError) as e:
        train.run(cfg)
    assert str(e.value).startswith(f"config field `run_dir`: {path} is {kind} (the run writes "), e.value
    assert str(e.value).endswith("move it aside (or make it writable), or choose another run_dir")


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"txt": "hello"}', r"d\.jsonl:2: no field 'text' \(its fields: \['txt'\]\); set data\.jsonl_field"),
        ('{"text": 17}', r"d\.jsonl:2: field 'text' is not a string but int"),
        ('["text", "a"]', r"d\.jsonl:2: a JSON list, not an object"),
        ('{"text": "a"', r"d\.jsonl:2: not JSON"),
    ],
)
def test_jsonl_errors_name_file_and_line(make_config, tmp_path, line, needle):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=needle):
        build_loaders(make_config(**{"data.source": "jsonl", "data.path": str(tmp_path / "d.jsonl")}))


def test_invalid_utf8_is_an_error_not_replaced(make_config, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"line one\nline two \xff\xfe\n")
    with pytest.raises(ValueError, match=r"a\.txt:2: not valid UTF-8 \(byte 18 of the file\)"):
        build_loaders(make_config(**{"data.source": "text", "data.path": str(tmp_path / "a.txt")}))
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not valid UTF-8"):
        build_loaders(make_config(**{"data.source": "jsonl", "data.path": str(tmp_path / "b.jsonl")}))


def test_token_files_of_the_wrong_length_shape_dtype_or_vocabulary(make_config, tmp_path):
    def load(path, **kw):
        return build_loaders(make_config(**{"data.source": "tokens", "data.path": str(path), **kw}))

    good = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16)
    good.tofile(tmp_path / "ok.bin")
    load(tmp_path / "ok.bin")
    (tmp_path / "odd.bin").write_bytes(good.tobytes() + b"\x01")
    with pytest.raises(ValueError, match=r"odd\.bin: 8001 bytes is not a whole number of uint16 tokens"):
        load(tmp_path / "odd.bin")
    np.save(tmp_path / "two.npy", good.reshape(40, 100))
    with pytest.raises(ValueError, match=r"two\.npy: a 2-D uint16 array; token files must be 1-D integer"):
        load(tmp_path / "two.npy")
    np.save(tmp_path / "float.npy", good.astype(np.float32))
    with pytest.raises(ValueError, match=r"float\.npy: a 1-D float32 array"):
        load(tmp_path / "float.npy")
    oov = good.copy()
    oov[-3] = 300  # one id past model.vocab_size=256, near the end: found before training
    oov.tofile(tmp_path / "oov.bin")
    with pytest.raises(ValueError, match=r"oov\.bin: token 3997 is 300, outside \[0, model\.vocab_size=256\)"):
        load(tmp_path / "oov.bin")


def test_tool_arguments(tmp_path, capsys):
    from boost_jax import evaluate, export, generate

    for args, needle in (
        (["--prompt", ""], "--prompt is empty"),
        (["--max_new_tokens", "-5"], "--max_new_tokens must be >= 1"),
        (["--top_k", "-1"], "--top_k and --temperature must be >= 0"),
    ):
        with pytest.raises(SystemExit) as e:
            generate.main(["--checkpoint", str(tmp_path), *args])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    for tool in (evaluate.main, generate.main):  # the tools take --checkpoint, and say so
        assert tool(["--checkpoint", str(tmp_path / "nowhere")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --checkpoint: ") and "restore_from" not in err, err
    (tmp_path / "file").write_text("x")
    assert export.main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "file")]) == 1
    assert "--out: " in capsys.readouterr().err and (tmp_path / "file").read_text() == "x"


def test_every_config_error_comes_at_once(tmp_path):
    """A short run of a zoo config (the CoLA recipe's 2,000 warmup steps and its token source without a
    path) names both problems at once, one `error:` line each, before anything compiles; so does a
    config with several broken fields, including checks that would divide by the broken ones."""
    rc, out, err = cli(
        "boost_jax.train", "--config", "cola_60m", "--config.train.steps=20", f"--config.run_dir={tmp_path / 'run'}"
    )
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 2 and "compiling" not in out, err
    assert lines[0].startswith("error: config field `train.warmup_steps`: must be in [0, train.steps=20]")
    assert lines[1].startswith("error: config field `data.path`: data.source='tokens' needs a path")
    from conftest import small_config

    cfg = small_config(
        tmp_path / "run",
        **{
            "model.n_heads": 0,
            "train.grad_accum": 0,
            "model.linear": "dense2",
            "model.attention": "flash",
            "parallel.linear_partition": "qkv=x",
            "train.lr": -1.0,
        },
    )
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    fields = [re.match(r"config field `([^`]+)`", p).group(1) for p in e.value.problems]
    assert fields == [
        "model.linear",
        "model.n_heads",
        "train.grad_accum",
        "train.lr",
        "model.attention",
        "parallel.linear_partition",
    ], e.value.problems
    assert str(e.value).splitlines() == e.value.problems


def test_the_eval_split_is_checked_with_the_data_before_anything_compiles(make_config, capsys, monkeypatch):
    """train.eval_tokens beyond what the held-out split holds is a one-line error at start-up, beside
    the data's other news (here the vocabulary warning), before the state is initialised or compiled;
    the numbers are the split's and the advice names data.eval_fraction, never an impossible size."""
    from boost_jax.data import build_loaders
    from boost_jax.runtime.build import Built

    def compiled(self):
        raise AssertionError("the state was initialised (compiled) before the data were checked")

    monkeypatch.setattr(Built, "init_state", compiled)
    cfg = make_config(**{"data.batching": "document", "train.eval_tokens": 10_000_000, "model.vocab_size": 1024})
    with pytest.raises(ConfigError) as e:
        train.run(cfg)
    _, held, _ = build_loaders(cfg)
    rows, tokens = held.readable_once()
    message = str(e.value)
    assert (
        message.startswith(
            f"config field `train.eval_tokens`: 10,000,000 tokens, but the eval split holds {tokens:,} in {rows:,} rows"
        )
        and "\n" not in message
    ), message
    assert f"at most {tokens - 1:,}" in message and "data.eval_fraction (now 0.05)" in message
    assert "warning: model.vocab_size=1024 is much larger than the tokenizer's 256" in capsys.readouterr().err


def test_context_kv_is_validated_at_any_context_size(make_config):
    """parallel.context_kv=bottleneck needs a factored kind without an extra term, and a strategy that
    keeps the rank whole, whatever parallel.context is (1 included)."""
    for context in (1, 2):
        with pytest.raises(ConfigError, match=r"`parallel\.context_kv`: .*model\.linear=dense has no bottleneck"):
            validate(
                make_config(
                    **{"model.linear": "dense", "parallel.context_kv": "bottleneck", "parallel.context": context}
                )
            )
        with pytest.raises(ConfigError, match=r"`parallel\.context_kv`: .*sltrain adds a full-width term"):
            validate(
                make_config(
                    **{"model.linear": "sltrain", "parallel.context_kv": "bottleneck", "parallel.context": context}
                )
            )
    validate(make_config(**{"parallel.context_kv": "bottleneck"}))  # cola under btp: fine at context 1
