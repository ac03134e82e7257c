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
