"""`python -m boost_jax.evaluate`: the trainer's eval loss from params alone, on any mesh or dataset."""
import json
import math

import pytest

from boost_jax import evaluate, train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import small_config
    cfg = small_config(tmp_path_factory.mktemp("eval") / "run", **{"train.steps": 4, "train.eval_every": 4,
                                                                    "checkpoint.every": 4})
    return cfg.run_dir, train.run(cfg)["evals"][-1]


def test_matches_the_trainers_eval_loss_on_any_mesh(run, tmp_path):
    run_dir, (step, trained) = run
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", run_dir, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["step"] == step == 4 and result["split"] == "eval" and result["batches"] == 2
    assert result["loss"] == pytest.approx(trained, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(trained), rel=1e-4)
    one = evaluate.evaluate(run_dir, lambda cfg: cfg.parallel.update(num_devices=1))
    assert one["mesh"] == {"pipeline": 1, "data": 1, "fsdp": 1, "tensor": 1}
    assert one["loss"] == pytest.approx(trained, rel=1e-5)


def test_another_dataset_and_bad_overrides(run, tmp_path, capsys):
    run_dir, (_, trained) = run
    text = tmp_path / "other.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    result = evaluate.evaluate(run_dir, lambda cfg: cfg.data.update(source="text", path=str(text)), batches=1)
    assert math.isfinite(result["loss"]) and result["loss"] != pytest.approx(trained, rel=1e-3)
    assert result["data"]["path"] == str(text)
    assert evaluate.main(["--checkpoint", run_dir, "--config.data.sorce=text"]) == 1
    assert "unknown key 'sorce'" in capsys.readouterr().err
    assert evaluate.main(["--checkpoint", str(tmp_path / "nowhere")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_eval_tokens_reads_documents_the_paper_way(tmp_path, capsys):
    """`evaluate --eval-tokens N` on a run trained with one document per row: whole batches until N
    input tokens were read, the loss the mean over their non-pad targets, against each document run
    alone (its own length, no padding, no mask) on one device."""
    import jax

    from boost_jax.data import build_loaders
    from boost_jax.runtime.build import load_model
    from conftest import small_config

    cfg = small_config(tmp_path / "run", **{"train.steps": 2, "train.eval_every": 0, "checkpoint.every": 2,
                                            "data.batching": "document", "data.eval_fraction": 0.2,
                                            "parallel.num_devices": 1})
    train.run(cfg)
    _, held, _ = build_loaders(cfg)
    budget = min(held.input_tokens(), 2 * cfg.train.global_batch * cfg.train.seq_len + 3)  # over 2 batches
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", cfg.run_dir, "--eval-tokens", str(budget), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    model, _, _ = load_model(cfg.run_dir)
    rows, seen, total, targets = 0, 0, 0.0, 0
    while seen < budget:  # whole batches of the unshuffled eval split, as CoLA's loop reads them
        batch = held.samples(range(rows, rows + cfg.train.global_batch))
        for tokens, n in zip(batch["tokens"], batch["lengths"]):
            seen += int(n)
            if n >= 2:
                doc = jax.numpy.asarray(tokens[None, :n])
                total += float(model.next_token_loss(doc, with_z_loss=False)) * (n - 1)
                targets += int(n) - 1
        rows += cfg.train.global_batch
    assert result["tokens"] == seen and result["batches"] == rows // cfg.train.global_batch
    assert result["loss"] == pytest.approx(total / targets, rel=1e-5)
    assert result["batching"] == "document"
    assert evaluate.main(["--checkpoint", cfg.run_dir, "--eval-tokens", str(10 ** 9)]) == 1
    assert "--eval-tokens" in capsys.readouterr().err


def _fake_result(**kw):
    return {"checkpoint": "/runs/x/checkpoints/4", "step": 4, "split": "eval", "loss": 3.0, "perplexity": 20.1,
            "batches": 1, "tokens": 8, "mesh": {"data": 1}, **kw}


def test_json_target_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: calls.append(a) or _fake_result())
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "eval.json", "does not exist")):
        assert evaluate.main(["--checkpoint", "RUN", "--json", str(bad)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --json") and why in err and err.count("\n") == 1, err
    assert calls == []  # refused before restoring or evaluating anything

    # The target turns unwritable during the evaluation (here: a directory appears there).
    out = tmp_path / "eval.json"
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: out.mkdir() or _fake_result())
    assert evaluate.main(["--checkpoint", "RUN", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --json {out}: cannot write") and err.count("\n") == 1, err


def test_non_finite_loss_exits_1(run, tmp_path, capsys, monkeypatch):
    run_dir, (step, _) = run
    monkeypatch.setattr(evaluate, "eval_loss", lambda *a, **k: {"loss": float("nan"), "batches": 2, "tokens": 64})
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", run_dir, "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: eval loss is nan at step {step}:") and "--checkpoint" in err, err
    result = json.loads(out.read_text())  # strict JSON: NaN is written as null
    assert result["loss"] is None and result["perplexity"] is None and result["step"] == step


def test_weights_that_overflow_exit_1(run, tmp_path, capsys):
    """A real non-finite loss: finite weights (the checkpoint accepts them) too large for float32 math."""
    import jax

    from boost_jax.runtime.checkpoint import Checkpointer, read_run, restore

    run_dir, (step, _) = run
    cfg, root, step = read_run(run_dir)
    built = evaluate.build_for_eval(cfg)
    restored = restore(root, built.spec.abstract, step=step)
    params = restored.state["params"]
    huge = {**params, "final_norm": jax.tree.map(lambda x: x * 1e37, params["final_norm"]),
            "lm_head": params["lm_head"] * 1e10}
    state = dict(restored.state, params=huge)  # logits past float32's 3.4e38: inf - inf is nan
    meta = {k: v for k, v in restored.meta.items() if k not in ("checksums", "param_shapes")}
    ckpt = Checkpointer(tmp_path / "huge" / "checkpoints", keep=1, async_save=False)
    ckpt.save(step, state, meta, force=True)
    ckpt.close()
    assert evaluate.main(["--checkpoint", str(tmp_path / "huge"), "--batches", "1"]) == 1
    err = capsys.readouterr().err
    assert "error: eval loss is" in err and f"at step {step}" in err, err
