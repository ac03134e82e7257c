"""parallel.plan=auto: the trainer runs the planner's best runnable plan for the devices it sees (8
emulated CPU devices priced as H100s here), prints the pick and its prediction beside the first logged
step times, and says in one line what it cannot do."""

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import small_config

from boost_jax import train
from boost_jax.config import base_config, check_fields, sized_config
from boost_jax.errors import ConfigError
from boost_jax.planner import Options, load_cluster, search
from boost_jax.planner import auto as auto_module
from boost_jax.planner.auto import plan_run
from boost_jax.runtime.build import build
from boost_jax.validate import validate

H100 = "clusters/h100_8x"
ROOT = Path(__file__).resolve().parents[1]
README_COMMAND = (
    "python -m boost_jax.train --config configs/cola_1b.py --config.parallel.plan=auto "
    "--config.data.path=/data/c4_tok --config.data.eval_path=/data/c4_val_tok --config.run_dir=runs/cola_1b_auto"
)


def test_auto_trains_on_the_planners_pick(tmp_path, capsys):
    # batch 4 on 8 devices: the default mesh (data 8) cannot split it, so the planner's pick is not it
    cfg = small_config(
        tmp_path / "run",
        **{
            "parallel.plan": "auto",
            "parallel.cluster": H100,
            "train.global_batch": 4,
            "train.steps": 4,
            "train.log_every": 1,
            "train.eval_every": 0,
        },
    )
    out = train.run(cfg)
    text = capsys.readouterr().out
    # the planner's own answer for these devices, asked directly
    want = search(cfg, load_cluster(H100), 8, Options(batch=4, seq=16, attention=cfg.model.attention, top=1))
    pick = want.best_runnable
    assert pick.mesh.data < 8
    ran = json.loads((tmp_path / "run" / "config.json").read_text())["parallel"]
    assert (ran["pipeline"], ran["data"], ran["fsdp"], ran["tensor"], ran["context"]) == (
        pick.mesh.pipeline,
        pick.mesh.data,
        pick.mesh.fsdp,
        pick.mesh.tensor,
        pick.mesh.context,
    )
    assert ran["strategy"] == pick.strategy and ran["plan"] == "explicit"  # the run's config is the plan's
    line = next(ln for ln in text.splitlines() if ln.startswith("parallel.plan=auto:"))
    assert f"mesh {pick.mesh} " in line and f"remat {pick.remat}" in line and "GB per GPU" in line
    # the start-up line names the mesh the step was built on (its devices' shape): the pick's
    sizes = dict(
        pipeline=pick.mesh.pipeline,
        data=pick.mesh.data,
        fsdp=pick.mesh.fsdp,
        context=pick.mesh.context,
        tensor=pick.mesh.tensor,
    )
    built = "x".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
    assert f", mesh {built} (parallel.plan=auto), strategy {pick.strategy}" in text
    # the first logged step times beside the prediction, in the output and metrics.jsonl
    assert len(re.findall(r"s per step, [0-9.e+]+x the planner's ", text)) == 3
    rows = [json.loads(ln) for ln in open(out["metrics"])]
    assert [r["planner_step_time_s"] for r in rows if "planner_step_time_s" in r] == [pytest.approx(pick.step_s)] * 4
    assert rows[0]["plan"] == "auto" and rows[0]["plan_overrides"] == pick.overrides
    assert out["step"] == 4
    # rerun for more steps: the same pick, compiled again, takes the restored state (its shardings)
    cfg.train.steps = 6
    again = train.run(cfg)
    assert again["step"] == 6 and "resum" in capsys.readouterr().out.lower()


def test_auto_with_mesh_sizes_set_is_one_line():
    cfg = base_config()
    cfg.parallel.plan, cfg.parallel.tensor, cfg.parallel.fsdp = "auto", 2, 2
    with pytest.raises(
        ConfigError,
        match=r"`parallel.plan`: auto picks the mesh itself, but parallel.fsdp=2, "
        r"parallel.tensor=2 set it too; drop them or set parallel.plan=explicit",
    ):
        check_fields(cfg)
    cfg = base_config()
    cfg.parallel.cluster = H100  # a cluster without auto: nothing would read it
    with pytest.raises(ConfigError, match="`parallel.cluster`: .* but parallel.plan=explicit"):
        check_fields(cfg)
    cfg.parallel.plan = "planner"
    with pytest.raises(ConfigError, match="`parallel.plan`: 'planner' is not one of"):
        check_fields(cfg)


def test_the_cluster_comes_from_the_device_kind_or_the_field():
    cfg = sized_config("60m", "cola")
    cfg.parallel.plan = "auto"
    _, auto = plan_run(cfg, 8, "NVIDIA H100 80GB HBM3")
    assert auto.cluster.name == "h100_8x" and auto.plan.mesh.devices == 8
    _, auto = plan_run(cfg, 8, "NVIDIA A100-SXM4-40GB")
    assert auto.cluster.name == "a100_4x"
    with pytest.raises(
        ConfigError,
        match=r"`parallel.cluster`: parallel.plan=auto has no cluster file for device "
        r"kind 'cpu'; name one, e.g. --config.parallel.cluster=clusters/h100_8x",
    ):
        plan_run(cfg, 8, "cpu")
    cfg.parallel.cluster = "clusters/no_such_gpu"
    with pytest.raises(ConfigError, match="`parallel.cluster`: no such file"):
        plan_run(cfg, 8, "cpu")


def test_a_plan_that_does_not_fit_is_one_line():
    cfg = sized_config("13b", "cola")  # 16 B of fp32 state per parameter: 13B does not fit one 80 GB GPU
    cfg.parallel.plan = "auto"
    with pytest.raises(ConfigError) as e:
        plan_run(cfg, 1, "NVIDIA H100 80GB HBM3")
    message = str(e.value)
    assert "\n" not in message and message.startswith("config field `parallel.plan`: auto: no plan for ")
    assert "fits 1 x h100_8x (72 GB usable per GPU); the smallest needs " in message
    assert message.endswith("use more devices or lower train.global_batch")


def test_readme_command(monkeypatch):
    """The README's auto command, parsed as the command line does, planned for 8 H100s: the pick line
    the README shows, and a config the trainer validates."""
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "docs" / "planner.md").read_text()  # the page that shows it
    assert README_COMMAND in readme
    cfg = train.parse_config(["train", *shlex.split(README_COMMAND)[3:]])
    resolved, auto = plan_run(cfg, 8, "NVIDIA H100 80GB HBM3")
    line = auto.describe()
    shown = line.split(" (clusters/h100_8x;")[0]
    assert f"\n{shown} (...)\n" in readme, line
    validate(resolved)
    assert resolved.parallel.fsdp * resolved.parallel.data * resolved.parallel.tensor * resolved.parallel.pipeline == 8


def _peak(cfg) -> int:
    """The compiled train step's peak bytes per device (arguments + outputs + temporaries - aliased)."""
    m = build(validate(cfg), validated=True).lower_train().compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def test_a_pick_that_does_not_fit_the_device_falls_back(tmp_path, capsys, monkeypatch):
    """A device memory (parallel.device_memory_gb) under the compiled peak of the planner's pick: the trainer
    says so in one line (the pick, its compiled GB, the device's GB) and trains the planner's next plan
    whose compiled step fits, named by its own line."""
    monkeypatch.setattr(auto_module, "MAX_COMPILES", 16)  # however many picks the ranking puts first
    cfg = small_config(
        tmp_path / "run",
        **{
            "parallel.plan": "auto",
            "parallel.cluster": H100,
            "train.global_batch": 4,
            "train.steps": 2,
            "train.log_every": 1,
            "train.eval_every": 0,
        },
    )
    cluster = load_cluster(H100)
    opts = Options(batch=4, seq=16, attention=cfg.model.attention, top=1)
    first = search(cfg, cluster, 8, opts).best_runnable
    memory = 0.95 * _peak(auto_module.apply(cfg, first.overrides))
    cfg.parallel.device_memory_gb = memory / 1e9
    out = train.run(cfg)
    lines = capsys.readouterr().out.splitlines()
    picks = [ln.strip().removeprefix("(explicitly: ").removesuffix(")") for ln in lines if "(explicitly: " in ln]
    over = [ln for ln in lines if " does not fit: " in ln]
    assert picks[0] == first.overrides and len(over) == len(picks) - 1 >= 1
    nexts = [ln for ln in lines if ln.startswith("parallel.plan=auto: next, ")]
    assert len(nexts) == len(over)
    tried = []
    for i, flags in enumerate(picks):  # each pick the planner's best runnable plan without the ones before
        want = search(cfg, cluster, 8, dataclasses.replace(opts, exclude=frozenset(tried))).best_runnable
        assert want.overrides == flags
        if i < len(over):
            line = over[i]
            assert line.startswith(f"parallel.plan=auto: the pick ({auto_module.short(want)}) does not fit: ")
            needs = float(re.search(r"needs ([0-9.e-]+) GB per device", line).group(1))
            assert needs * 1e9 > memory and f"the device has {memory / 1e9:.3g} GB (parallel.device_memory_gb)" in line
        if i > 0:  # taken as the next plan after the pick before it did not fit: its line names it
            assert f"mesh {want.mesh} " in nexts[i - 1]
            assert f"strategy {want.strategy}, remat {want.remat_label}, " in nexts[i - 1]
        tried.append(flags)
    last = auto_module.apply(cfg, picks[-1])
    assert _peak(last) <= memory  # the plan it trained fits, compiled again here
    ran = json.loads((tmp_path / "run" / "config.json").read_text())["parallel"]
    assert (ran["data"], ran["fsdp"], ran["tensor"], ran["strategy"]) == (
        last.parallel.data,
        last.parallel.fsdp,
        last.parallel.tensor,
        last.parallel.strategy,
    )
    assert out["step"] == 2


def test_no_pick_that_fits_is_one_line(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.plan": "auto"})
    said = []
    with pytest.raises(ConfigError) as e:
        auto_module.fitting_plan(cfg, 8, "H100", lambda run: (80e9, None), lambda c: (60e9, "test"), said.append)
    message = str(e.value)
    assert "\n" not in message and message.startswith("config field `parallel.plan`: auto: none of the planner's ")
    assert f"{auto_module.MAX_COMPILES} best plans for" in message and "within 60 GB per device (test)" in message
    assert message.endswith("set the mesh yourself with parallel.plan=explicit")
    assert sum("does not fit: its compiled train step needs 80 GB per device, the device has 60 GB" in s for s in said)
    cfg = base_config()
    cfg.parallel.device_memory_gb = 40.0  # nothing reads it without auto
    with pytest.raises(ConfigError, match="`parallel.device_memory_gb`: .* but parallel.plan=explicit"):
        check_fields(cfg)
