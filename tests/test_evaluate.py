"""`python -m boost_jax.evaluate`: the trainer's eval loss from params alone, on any mesh or dataset."""

import json
import math
import re

import numpy as np
import pytest

from boost_jax import evaluate, train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import small_config

    cfg = small_config(
        tmp_path_factory.mktemp("eval") / "run", **{"train.steps": 4, "train.eval_every": 4, "checkpoint.every": 4}
    )
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
    assert one["mesh"] == {"pipeline": 1, "data": 1, "fsdp": 1, "context": 1, "tensor": 1}
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


def colas_evaluation(rows, global_batch: int, slices: int, budget: int) -> dict:
    """CoLA's `evaluate_model` in plain numpy, over rows [(loss summed over the row's targets, targets,
    non-pad tokens)] in eval order: `slices` GPUs each read a batch of global_batch/slices rows per
    iteration (GPU j the rows j, slices+j, ... of the iteration's global batch); before an iteration
    the loop breaks if the tokens counted so far exceed `budget`; each GPU sums its batches' mean
    losses and divides by its batch counter, which starts at 1; the GPUs' results are averaged. Also
    the loss per target token over the same rows. The split's last batch may be short (the budget
    reaches past its whole batches): its mean is over the GPUs that got rows of it."""
    cola, total, targets, seen, n = [], 0.0, 0, 0, 0
    while True:
        if seen > budget:
            break
        batch = rows[n * global_batch : (n + 1) * global_batch]
        assert batch, "CoLA's loop would need rows past the split's end"
        means = [
            sum(r[0] for r in batch[j::slices]) / max(sum(r[1] for r in batch[j::slices]), 1)
            for j in range(slices)
            if batch[j::slices]
        ]
        cola.append(np.mean(means))
        total += sum(r[0] for r in batch)
        targets += sum(r[1] for r in batch)
        seen += sum(r[2] for r in batch)
        n += 1
    return {"cola_loss": float(np.sum(cola) / (n + 1)), "loss": total / targets, "tokens": seen, "batches": n}


def test_eval_rule_is_colas_on_fresh_random_rows():
    """runtime/evaluation.py's rule against `colas_evaluation`, on random documents and random per-row
    losses (an eval step that looks each row's loss up): budgets inside a batch, exactly at a batch
    boundary (CoLA's `>` reads one batch more), past the split's whole batches (its last batch is
    partial) and one short of the whole split; more than that is a one-line error naming how many
    tokens the split holds."""
    import types

    import jax

    from boost_jax.data import DocumentLoader
    from boost_jax.errors import ConfigError
    from boost_jax.runtime.evaluation import eval_loss

    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    seq_len, g, slices = 16, 8, 4
    lengths = rng.integers(1, 40, 203)
    docs = [np.append([j], rng.integers(0, 1000, n - 1)).astype(np.uint16) for j, n in enumerate(lengths)]
    data = DocumentLoader(
        [np.concatenate(docs)],
        [np.cumsum(lengths)],
        seq_len=seq_len,
        name="t",
        global_batch=g,
        seed=0,
        vocab_size=1024,
        shuffle=False,
    )
    per_target = rng.uniform(0.5, 5.0, len(docs))  # the "model": a loss per target of each document
    kept = np.minimum(lengths, seq_len)
    rows = [(per_target[j] * max(kept[j] - 1, 0), max(kept[j] - 1, 0), kept[j]) for j in range(len(docs))]

    def eval_step(params, batch):  # per slice: (loss summed over its targets, its targets, its tokens)
        lengths = np.asarray(batch["lengths"])
        ids = np.asarray(batch["tokens"])[:, 0].tolist()  # each document's first token is its number
        real = [j if n else None for j, n in zip(ids, lengths)]  # length 0: a padding row
        assert all(lengths[k] == kept[j] for k, j in enumerate(real) if j is not None)
        got = [[rows[j] for j in real[s::slices] if j is not None] for s in range(slices)]
        return tuple(np.array([sum(r[k] for r in part) for part in got]) for k in range(3))

    cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(
            global_batch=g, seq_len=seq_len, eval_batches=2, eval_tokens=0, eval_microbatches=slices, grad_accum=1
        ),
        data=types.SimpleNamespace(eval_path="", eval_fraction=0.05),
    )
    built = types.SimpleNamespace(
        cfg=cfg, eval_step=eval_step, eval_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    whole = len(docs) // g
    have = int(sum(r[2] for r in rows))
    assert data.readable_once() == (len(docs), have)
    boundary = int(sum(r[2] for r in rows[: 3 * g]))
    past = int(sum(r[2] for r in rows[: whole * g])) + 1  # into the split's last, partial batch
    for budget in (1, int(rng.integers(2, have - 1)), boundary, boundary - 1, past, have - 1):
        got = eval_loss(built, data, None, tokens=budget)
        want = colas_evaluation(rows, g, slices, budget)
        assert (got["tokens"], got["batches"]) == (want["tokens"], want["batches"]), (seed, budget)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9), (seed, budget)
        assert got["cola_loss"] == pytest.approx(want["cola_loss"], rel=1e-9), (seed, budget)
        assert got["cola_denominator"] == want["batches"] + 1 and got["cola_batch_rows"] == g // slices
    assert eval_loss(built, data, None, tokens=boundary)["batches"] == 4  # `>`: exactly 3 batches' tokens read 4
    last = eval_loss(built, data, None, tokens=have - 1)
    assert (last["batches"], last["rows"], last["padding_rows"]) == (whole + 1, len(docs), (whole + 1) * g - len(docs))
    with pytest.raises(ConfigError, match=f"holds {have:,} in {len(docs)} rows.*at most {have - 1:,}") as e:
        eval_loss(built, data, None, tokens=have, field="--eval-tokens")
    assert str(e.value).startswith("config field `--eval-tokens`") and "\n" not in str(e.value)


def test_eval_tokens_reads_documents_the_paper_way(tmp_path, capsys):
    """`evaluate --eval-tokens N` on a run trained with one document per row (in 2 eval slices): both
    forms of the loss against `colas_evaluation` over each document run alone (its own length, no
    padding, no mask) on one device."""
    import jax
    from conftest import small_config

    from boost_jax.data import build_loaders
    from boost_jax.runtime.build import load_model

    rng = np.random.default_rng()
    words = ["def", "return", "value", "x", "lambda", "class", "import", "self"]
    texts = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(300)]  # many short documents
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = small_config(
        tmp_path / "run",
        **{
            "train.steps": 2,
            "train.eval_every": 0,
            "checkpoint.every": 2,
            "data.batching": "document",
            "data.eval_fraction": 0.2,
            "data.source": "jsonl",
            "data.path": str(tmp_path / "docs.jsonl"),
            "parallel.num_devices": 1,
            "train.eval_microbatches": 2,
        },
    )
    train.run(cfg)
    _, held, _ = build_loaders(cfg)
    budget = min(held.input_tokens(), 2 * cfg.train.global_batch * cfg.train.seq_len + 3)  # over 2 batches
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", cfg.run_dir, "--eval-tokens", str(budget), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    model, _, _ = load_model(cfg.run_dir)
    g = cfg.train.global_batch
    rows = []
    for k in range(result["batches"] + 1):
        batch = held.samples(range(k * g, (k + 1) * g))
        for tokens, n in zip(batch["tokens"], batch["lengths"]):
            doc = jax.numpy.asarray(tokens[None, :n])
            loss = float(model.next_token_loss(doc, with_z_loss=False)) * (n - 1) if n >= 2 else 0.0
            rows.append((loss, max(int(n) - 1, 0), int(n)))
    want = colas_evaluation(rows, g, 2, budget)
    assert (result["tokens"], result["batches"]) == (want["tokens"], want["batches"])
    assert result["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert result["cola_loss"] == pytest.approx(want["cola_loss"], rel=1e-5)
    assert result["cola_perplexity"] == pytest.approx(math.exp(want["cola_loss"]), rel=1e-4)
    assert result["batching"] == "document" and "CoLA's reported form" in printed and "n+1" in printed
    assert evaluate.main(["--checkpoint", cfg.run_dir, "--eval-tokens", str(10**9)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: config field `--eval-tokens`") and err.count("\n") == 1 and "hold" in err


def _fake_result(**kw):
    return {
        "checkpoint": "/runs/x/checkpoints/4",
        "step": 4,
        "split": "eval",
        "loss": 3.0,
        "perplexity": 20.1,
        "batches": 1,
        "tokens": 8,
        "mesh": {"data": 1},
        "cola_loss": 1.5,
        "cola_perplexity": 4.5,
        "cola_denominator": 2,
        "cola_batch_rows": 4,
        **kw,
    }


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
    monkeypatch.setattr(
        evaluate,
        "eval_loss",
        lambda *a, **k: {
            "loss": float("nan"),
            "batches": 2,
            "tokens": 64,
            "cola_loss": float("nan"),
            "cola_denominator": 3,
            "cola_batch_rows": 4,
        },
    )
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", run_dir, "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: eval loss is nan at step {step}:") and "--checkpoint" in err, err
    result = json.loads(out.read_text())  # strict JSON: NaN is written as null
    assert result["loss"] is None and result["perplexity"] is None and result["step"] == step


def test_weights_that_overflow_exit_1(run, tmp_path, capsys):
    """A real non-finite loss: finite weights (the checkpoint accepts them) too large for float32 math."""
    import jax

    from boost_jax.runtime.checkpoints.store import Checkpointer, read_run, restore

    run_dir, (step, _) = run
    cfg, root, step = read_run(run_dir)
    built = evaluate.build_for_eval(cfg)
    restored = restore(root, built.spec.abstract, step=step)
    params = restored.state["params"]
    huge = {
        **params,
        "final_norm": jax.tree.map(lambda x: x * 1e37, params["final_norm"]),
        "lm_head": params["lm_head"] * 1e10,
    }
    state = dict(restored.state, params=huge)  # logits past float32's 3.4e38: inf - inf is nan
    meta = {k: v for k, v in restored.meta.items() if k not in ("checksums", "param_shapes")}
    ckpt = Checkpointer(tmp_path / "huge" / "checkpoints", keep=1, async_save=False)
    ckpt.save(step, state, meta, force=True)
    ckpt.close()
    assert evaluate.main(["--checkpoint", str(tmp_path / "huge"), "--batches", "1"]) == 1
    err = capsys.readouterr().err
    assert "error: eval loss is" in err and f"at step {step}" in err, err


# ---------------------------------------------------------------- a held-out split smaller than one batch


def _small_split_config(tmp_path, batching, **kw):
    """A run on random JSONL documents whose held-out file (data.eval_path) holds 5 short documents:
    fewer rows than one global batch of 8 under every batching (stream: at most 7 windows of 17)."""
    from conftest import small_config

    rng = np.random.default_rng()
    words = ["def", "return", "value", "x", "lambda", "class", "import", "self"]
    tmp_path.mkdir(parents=True, exist_ok=True)

    def write(name, n, longest):
        texts = []
        for _ in range(n):
            text = " ".join(rng.choice(words, rng.integers(2, 12)))
            texts.append(text[: int(rng.integers(6, longest))])
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return str(tmp_path / name)

    return small_config(
        tmp_path / "run",
        **{
            "data.source": "jsonl",
            "data.path": write("train.jsonl", 400, 60),
            "data.eval_path": write("held.jsonl", 5, 24),
            "data.batching": batching,
            "train.eval_microbatches": 2,
            **kw,
        },
    )


def _pieces(batching, rows, n_tokens):
    """The token pieces a row holds that are read alone in the reference: a stream window, a
    document's tokens, each document of a packed row."""
    tokens = rows["tokens"]
    if batching == "stream":
        return [list(r) for r in tokens]
    if batching == "document":
        return [list(r[:n]) for r, n in zip(tokens, rows["lengths"])]
    return [list(r[s == k]) for r, s in zip(tokens, rows["segments"]) for k in range(1, s.max() + 1)]


def test_a_split_smaller_than_one_batch_is_read_once_in_every_batching(tmp_path):
    """For stream, packed and document rows: a held-out split of fewer rows than one global batch is
    evaluated as one partial batch, on 8 devices (data axis) and on one: the rows the eval step reads
    are the split's rows, each once (the rest padding), and the loss is that of a plain loop running
    each row's pieces alone on one device (float64 sums); asking for more batches says so."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from boost_jax.data import build_loaders
    from boost_jax.model import autos, model_from_config
    from boost_jax.parallel.mesh import ONE_DEVICE
    from boost_jax.runtime.build import build
    from boost_jax.runtime.evaluation import eval_loss, plan_eval

    alone, params = {}, None  # (loss of a piece run alone), the parameters (one init serves every batching)
    for batching in ("stream", "packed", "document"):
        cfg = _small_split_config(tmp_path / batching, batching, **{"train.eval_batches": 3})
        _, held, _ = build_loaders(cfg)
        n, have = held.readable_once()
        g = cfg.train.global_batch
        assert 0 < n < g, (batching, n)
        split = held.samples(range(n))
        reading = plan_eval(cfg, held)
        assert (
            reading.rows == n and f"holds {n} rows ({have:,} tokens), fewer than train.eval_batches=3" in reading.note
        )

        if params is None:
            params = jax.device_get(build(cfg).init_state()["params"])
            one = cfg.copy_and_resolve_references()
            one.parallel.update(ONE_DEVICE)
            one = autos.apply(one, autos.chosen(one))  # `auto` resolved for one device
            graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_from_config(one)))  # noqa: B023
            model = nnx.merge(graphdef, params)
        sums, targets, tokens = 0.0, 0, 0
        for piece in _pieces(batching, split, cfg.train.seq_len):
            tokens += len(piece) if batching != "stream" else cfg.train.seq_len
            if len(piece) >= 2:
                if tuple(piece) not in alone:
                    alone[tuple(piece)] = float(
                        model.next_token_loss(jnp.asarray([piece], jnp.int32), with_z_loss=False)
                    )
                sums += alone[tuple(piece)] * (len(piece) - 1)
                targets += len(piece) - 1

        for devices in (jax.devices(), jax.devices()[:1]):
            on = cfg.copy_and_resolve_references()
            if len(devices) == 1:
                on.parallel.update(ONE_DEVICE)
            b = build(on, devices)
            assert b.mesh.shape["data"] == len(devices)
            read = []
            step = b.eval_step

            def spy(p, batch, step=step, read=read):
                got = jax.device_get(batch)
                real = (
                    got["rows"]
                    if batching == "stream"
                    else got["lengths"] > 0
                    if batching == "document"
                    else got["segments"].any(axis=1)
                )
                read.extend(bytes(np.asarray(r, np.int32)) for r in got["tokens"][real])
                return step(p, batch)

            b.eval_step = spy
            result = eval_loss(b, held, jax.device_put(params, b.spec.shardings["params"]), plan=reading)
            assert sorted(read) == sorted(bytes(np.asarray(r, np.int32)) for r in split["tokens"]), batching
            assert (result["batches"], result["rows"], result["padding_rows"]) == (1, n, g - n)
            assert (result["tokens"], result["targets"]) == (tokens, targets), batching
            assert result["loss"] == pytest.approx(sums / targets, rel=2e-5), (batching, len(devices))


def test_the_trainer_and_evaluate_read_a_small_split_once(tmp_path, capsys):
    """The trainer's evaluations and `evaluate` on a run whose held-out split is smaller than one batch
    (one document per row): both read its rows once, say so, log the counts and agree; more tokens
    than it holds is one line naming data.eval_path and the numbers, with no impossible size."""
    from boost_jax.data import build_loaders

    cfg = _small_split_config(tmp_path, "document", **{"train.steps": 2, "train.eval_every": 2, "checkpoint.every": 2})
    out = train.run(cfg)
    printed = capsys.readouterr().out
    _, held, _ = build_loaders(cfg)
    n, have = held.n, held.input_tokens()  # the split's rows and tokens
    assert n < cfg.train.global_batch and f"note: the eval split holds {n} rows ({have:,} tokens)" in printed
    from tests_support import metric_rows

    assert metric_rows(cfg.run_dir, "eval_rows") == {0: n, 2: n}
    assert metric_rows(cfg.run_dir, "eval_tokens") == {0: have, 2: have}
    result = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", cfg.run_dir, "--json", str(result)]) == 0
    got = json.loads(result.read_text())
    assert got["loss"] == pytest.approx(out["evals"][-1][1], rel=1e-6) and got["rows"] == got["split_rows"] == n
    assert f"{n} rows (the last batch partial: {8 - n} padding rows masked)" in capsys.readouterr().out
    assert evaluate.main(["--checkpoint", cfg.run_dir, "--eval-tokens", str(10**11)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: config field `--eval-tokens`: 100,000,000,000 tokens")
    assert f"holds {have:,} in {n} rows" in err and f"at most {have - 1:,}" in err and "data.eval_path" in err
    assert not re.search(r"at most (-|0\b)", err)
