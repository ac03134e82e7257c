"""The commands' first hour: `train --help` lists every config key with its default and meaning,
`--print_config` prints the resolved config, `--config NAME` finds a packaged config."""

from pathlib import Path

import ml_collections
import pytest

from boost_jax import train
from boost_jax.config import base_config, config_docs, config_path, packaged_configs


def _keys(node, path=""):
    for k in node.keys():
        v = node[k]
        if isinstance(v, ml_collections.ConfigDict):
            yield from _keys(v, f"{path}{k}.")
        else:
            yield f"{path}{k}", v


def test_help_lists_every_key_with_default_and_meaning(capsys):
    assert train.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split("=", 1)[0].strip(): ln for ln in out.splitlines() if ln.strip().startswith("--config.")}
    docs = config_docs()
    for key, default in _keys(base_config()):
        line = lines.get(f"--config.{key}")
        assert line is not None, f"train --help does not list {key}"
        assert f"--config.{key}={default!r}" in line, line
        assert len(docs[key].split()) >= 2 and docs[key] in line, f"{key}: no meaning in its comment in base_config"
    assert "--print_config" in out and "--config FILE|NAME" in out


def test_print_config_shows_the_resolved_config(capsys):
    assert train.main(["train", "--config", "cola_60m", "--config.train.steps=123", "--print_config"]) == 0
    out = capsys.readouterr().out
    cfg = train.parse_config(["train", "--config=cola_60m", "--config.train.steps=123"])
    assert cfg.train.steps == 123 and cfg.name == "cola_60m"
    body, _, auto = out.strip().rpartition("\n")
    assert body.strip() == str(cfg).strip() and "  steps: 123" in out and "  batching: document" in out
    # The last line: what `auto` resolves to here (model/autos.py): CPUs keep XLA's norm and the scan.
    assert auto.startswith("# auto, on 8 x ") and auto.endswith(
        "group_linears false, scan_unroll false, remat none, rmsnorm xla, gate_kernel xla"
    ), auto
    assert "  group_linears: auto" in body and "  policy: auto" in body


def test_packaged_config_names(tmp_path, monkeypatch, capsys):
    names = packaged_configs()
    assert {"tiny", "cola_60m", "llama_7b", "clusters/a100_4x"} <= set(names)
    same = {Path(config_path(n)).resolve() for n in ("cola_60m", "cola_60m.py", "configs/cola_60m.py")}
    assert len(same) == 1 and same.pop().is_file()
    monkeypatch.chdir(tmp_path)  # not a checkout: configs/x.py is found in the package
    assert config_path("configs/cola_60m.py").endswith("boost_jax/configs/cola_60m.py")
    (tmp_path / "mine.py").write_text(
        "from boost_jax.config import base_config\n\ndef get_config():\n"
        "    c = base_config()\n    c.name = 'mine'\n    return c\n"
    )
    assert config_path("mine.py") == "mine.py"  # a file wins
    assert train.parse_config(["train", "--config", "mine.py"]).name == "mine"
    with pytest.raises(SystemExit):
        train.parse_config(["train", "--config", "cola_6m"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cola_6m" in err and "cola_60m" in err, err


def test_a_vocabulary_much_larger_than_the_tokenizers_is_warned(tmp_path, capsys):
    """A 52-piece tokenizer under model.vocab_size=32000 trains, but says which rows no id reaches."""
    tokenizers = pytest.importorskip("tokenizers")
    from conftest import small_config

    from boost_jax.data import build_loaders

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({**{f"w{k}": k + 2 for k in range(50)}, "<unk>": 0, "</s>": 1}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "t.txt").write_text(" ".join(f"w{k % 50}" for k in range(3000)))
    for vocab, warned in ((32000, True), (64, False)):
        cfg = small_config(
            tmp_path / f"run{vocab}",
            **{
                "data.source": "text",
                "data.path": str(tmp_path / "t.txt"),
                "data.tokenizer": str(tmp_path / "tok.json"),
                "model.vocab_size": vocab,
            },
        )
        build_loaders(cfg)
        err = capsys.readouterr().err
        assert ("model.vocab_size=32000 is much larger than the tokenizer's 52" in err) == warned, err
        if warned:
            assert err.count("\n") == 1 and "--config.model.vocab_size=52" in err


def test_prepare_names_the_eval_path_for_a_validation_split(tmp_path, capsys):
    from boost_jax.data import prepare

    (tmp_path / "val.jsonl").write_text('{"text": "a held-out document"}\n' * 5)
    assert prepare.main([str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "val_tok"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (
        f"--config.data.eval_path={tmp_path / 'val_tok'}" in out and f"--config.data.path={tmp_path / 'val_tok'}" in out
    )
