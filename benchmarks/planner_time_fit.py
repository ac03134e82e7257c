"""The planner's step time against measured steps on one GPU, and the fit of its time constants to them.

    python benchmarks/planner_time_fit.py [--measured benchmarks/h100_measured.json]
        [--cluster configs/clusters/h100_8x.py] [--fit NAME,...] [--json PATH] [--markdown PATH] [--write]

Each measured row (benchmarks/h100_measured.json: config, seq, batch, overrides, step_ms, ...) is priced
as the plan the step ran: one device, no gradient accumulation, the row's remat policy, attention and
kernels. The planner's step time is linear in four cluster constants, 1/gemm_efficiency,
1/flash_efficiency, elementwise_passes and kept_passes (on one device nothing is hidden behind
anything), so each row's time is a + f . theta with a and f read by pricing it at two points.

The fit: least squares of the relative error over the `fit` rows, for every subset of those
constants (each within its physical range: an efficiency in (0, 1], passes >= 0), scored by
leave-one-out (each row predicted by the constants fitted to the others). The smallest subset
whose leave-one-out RMS error is within LOO_SLACK of the best is taken (`--fit` names one
instead). The constants the fit does not take keep the cluster file's datasheet values.

The table prints every row (fit, held out, unmodelled) measured against the planner with the
datasheet constants (no fit), with the cluster file as it is and with the new fit, and per
(config, seq, batch, overrides) with two or more remat policies measured, the planner's remat pick
(its one-device search) against the measured fastest. `--write` puts the fitted constants into the
cluster file (a block between FIT_BEGIN and FIT_END that overrides the datasheet values above it):
after new measurements, add the rows to the JSON file and run this with --write.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MEASURED = ROOT / "benchmarks/h100_measured.json"
# the date the gate product and σ went inside the GEMMs (kernels/gated_gemm.py, model.gate_kernel=gemm
# and model.bottleneck_kernel under `auto`): a row measured before ran XLA's, whatever `auto` picks now
KERNELS_IN_GEMMS_SINCE = "2026-11-29"
CLUSTER = ROOT / "configs/clusters/h100_8x.py"
# (constant, True when the time is linear in its inverse): what the fit may set
FITTABLE = (
    ("gemm_efficiency", True),
    ("flash_efficiency", True),
    ("elementwise_passes", False),
    ("kept_passes", False),
)
ROLES = ("fit", "held_out", "unmodelled")
TOLERANCE = 0.15  # the planner's step time against the measured one (tests/test_planner_time.py)
LOO_SLACK = 0.01  # a bigger subset of constants must beat the smallest by this much leave-one-out RMS
FIT_BEGIN = "    # planner_time_fit: begin"
FIT_END = "    # planner_time_fit: end"
ROW_FIELDS = {
    "config": str,
    "seq": int,
    "batch": int,
    "overrides": dict,
    "step_ms": (int, float),
    "device_kind": str,
    "date": str,
    "source": str,
    "role": str,
}


# ---------------------------------------------------------------- the measured rows


def load_rows(path=MEASURED) -> list[dict]:
    """The rows of a measured-steps file, checked (a bad row: one line naming the file, the row and
    the field)."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected a JSON object with a `rows` list ({type(e).__name__}: {e})") from None
    for i, r in enumerate(rows):
        where = f"{path} row {i}"
        if not isinstance(r, dict):
            raise ValueError(f"{where}: a row is an object with {sorted(ROW_FIELDS)}")
        for field, kind in ROW_FIELDS.items():
            if field not in r or not isinstance(r[field], kind) or isinstance(r[field], bool):
                raise ValueError(f"{where}: `{field}` is missing or not a {getattr(kind, '__name__', 'number')}")
        if r["role"] not in ROLES:
            raise ValueError(f"{where}: `role` {r['role']!r} is not one of {ROLES}")
        if min(r["seq"], r["batch"]) < 1 or not r["step_ms"] > 0:
            raise ValueError(f"{where}: seq, batch and step_ms must be positive")
        if not (ROOT / "configs" / f"{r['config']}.py").is_file():
            raise ValueError(f"{where}: `config` {r['config']!r} names no configs/{r['config']}.py")
    return rows


def key(row: dict) -> tuple:
    """What identifies a measured plan: config, seq, batch, overrides."""
    return row["config"], row["seq"], row["batch"], json.dumps(row["overrides"], sort_keys=True)


def newest(rows: list[dict]) -> list[dict]:
    """One row per plan: the newest measurement (the later one in the file on the same date)."""
    out: dict = {}
    for r in rows:
        if key(r) not in out or r["date"] >= out[key(r)]["date"]:
            out[key(r)] = r
    return list(out.values())


def row_config(row: dict):
    """The row's config: configs/NAME.py with its overrides, seq and batch."""
    from boost_jax.config import load_config_file
    from boost_jax.model import autos

    cfg = load_config_file(ROOT / "configs" / f"{row['config']}.py")
    for dotted, value in row["overrides"].items():
        node, *path = cfg, *dotted.split(".")
        for part in path[:-1]:
            node = node[part] if part in node else None
            if node is None:
                break
        if node is None or path[-1] not in node:
            raise ValueError(f"{MEASURED.name}: override {dotted!r} of {row['config']} is not a config field")
        node[path[-1]] = value
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.grad_accum = row["seq"], row["batch"], 1
    cfg.model.max_seq_len = max(int(cfg.model.max_seq_len), row["seq"])
    if row["date"] < KERNELS_IN_GEMMS_SINCE:  # the step ran XLA's gate product and σ (the kernels came later)
        for name in ("gate_kernel", "bottleneck_kernel"):
            if f"model.{name}" not in row["overrides"]:
                cfg.model[name] = "xla"
    # What `auto` left in the row resolves to on the one GPU it ran on (boost_jax/model/autos.py).
    picks = autos.rules(cfg, gpu=True, sizes={}, triton=True)
    with cfg.ignore_type():
        for dotted, value in picks.items():
            section, name = dotted.split(".")
            cfg[section][name] = value
    return cfg


def price(row: dict, cluster):
    """The planner's Plan of the step the row measured: one device, no accumulation, its remat policy."""
    from boost_jax.planner import Layer, Mesh, Options, plan_for

    cfg = row_config(row)
    one_device = Layer("R", ("none",) * 4, "R", "R")  # tensor 1: every group whole, activations replicated
    opts = Options(batch=row["batch"], seq=row["seq"], attention=cfg.model.attention, check_memory=False)
    return plan_for(cfg, cluster, Mesh(1, 1, 1), 1, cfg.remat.policy, one_device, opts)


# ---------------------------------------------------------------- the constants


def theta(cluster, names) -> list[float]:
    inverse = dict(FITTABLE)
    return [1 / getattr(cluster, n) if inverse[n] else getattr(cluster, n) for n in names]


def with_theta(cluster, names, values):
    inverse = dict(FITTABLE)
    return dataclasses.replace(cluster, **{n: 1 / v if inverse[n] else v for n, v in zip(names, values)})


def features(row: dict, cluster) -> tuple[float, list[float]]:
    """(a, f): the row's predicted step (seconds) = a + sum f_k theta_k over FITTABLE, read by
    pricing at the cluster's theta and with each theta_k raised; checked at a third point."""
    names = [n for n, _ in FITTABLE]
    t0 = theta(cluster, names)
    base = dataclasses.replace(cluster, kept_passes=cluster.kept_passes or 1.0)  # theta_k = 0 reads nothing
    t0[-1] = base.kept_passes
    s0 = price(row, base).step_s
    f = []
    for k in range(len(names)):
        t = list(t0)
        t[k] *= 2
        f.append((price(row, with_theta(base, names, t)).step_s - s0) / t0[k])
    a = s0 - sum(fk * tk for fk, tk in zip(f, t0))
    t = [1.7 * x for x in t0]
    check = price(row, with_theta(base, names, t)).step_s
    if abs(check - (a + sum(fk * tk for fk, tk in zip(f, t)))) > 1e-9 + 1e-6 * check:
        raise RuntimeError(f"{row['config']}: the planner's step is not linear in {names} (the fit assumes it)")
    return a, f


def feasible(names, values) -> bool:
    inverse = dict(FITTABLE)
    return all(v >= 1.0 if inverse[n] else v >= 0.0 for n, v in zip(names, values))


def solve(rows: list[int], feats: list, measured: list[float], cluster, names) -> list[float] | None:
    """theta of `names` (the rest at the cluster's values) minimising the relative error over `rows`;
    None when the least-squares solution leaves a constant's physical range."""
    import numpy as np

    every = [n for n, _ in FITTABLE]
    t = dict(zip(every, theta(cluster, every)))
    fixed = [n for n in every if n not in names]
    X, y = [], []
    for i in rows:
        a, f = feats[i]
        fd = dict(zip(every, f))
        X.append([fd[n] / measured[i] for n in names])
        y.append((measured[i] - a - sum(fd[n] * t[n] for n in fixed)) / measured[i])
    sol, *_ = np.linalg.lstsq(np.asarray(X), np.asarray(y), rcond=None)
    sol = [float(x) for x in sol]
    return sol if feasible(names, sol) else None


def predict(feat, cluster, names, values) -> float:
    every = [n for n, _ in FITTABLE]
    t = dict(zip(every, theta(cluster, every)))
    t.update(zip(names, values))
    a, f = feat
    return a + sum(fk * t[n] for fk, n in zip(f, every))


def candidates(feats, measured, fit_rows, cluster) -> list[dict]:
    """Every subset of FITTABLE with its in-sample fit and leave-one-out errors (relative)."""
    import numpy as np

    every = [n for n, _ in FITTABLE]
    out = []
    for size in range(1, len(every) + 1):
        for names in itertools.combinations(every, size):
            if len(fit_rows) <= size + 1:
                continue
            values = solve(fit_rows, feats, measured, cluster, names)
            loo = []
            for i in fit_rows:
                v = solve([j for j in fit_rows if j != i], feats, measured, cluster, names)
                loo.append(None if v is None else predict(feats[i], cluster, names, v) / measured[i] - 1)
            ok = values is not None and None not in loo
            ins = [predict(feats[i], cluster, names, values) / measured[i] - 1 for i in fit_rows] if ok else []
            out.append(
                {
                    "constants": list(names),
                    "values": values,
                    "feasible": ok,
                    "in_sample_max": max(map(abs, ins)) if ok else None,
                    "loo_rms": float(np.sqrt(np.mean(np.square(loo)))) if ok else None,
                    "loo_max": max(map(abs, loo)) if ok else None,
                }
            )
    return out


def choose(cands: list[dict]) -> dict:
    """The smallest feasible subset within LOO_SLACK of the best leave-one-out RMS."""
    ok = [c for c in cands if c["feasible"]]
    if not ok:
        raise SystemExit("no subset of the constants fits within their physical ranges; check the rows")
    best = min(c["loo_rms"] for c in ok)
    return min((c for c in ok if c["loo_rms"] <= best + LOO_SLACK), key=lambda c: (len(c["constants"]), c["loo_rms"]))


def fitted_cluster(cluster, names, values):
    return with_theta(cluster, names, values)


def constant_values(names, values) -> dict:
    inverse = dict(FITTABLE)
    return {n: (1 / v if inverse[n] else v) for n, v in zip(names, values)}


# ---------------------------------------------------------------- the cluster file


def strip_fit(text: str) -> str:
    """The cluster file without its fitted block (its datasheet values)."""
    if FIT_BEGIN not in text:
        return text
    head, rest = text.split(FIT_BEGIN, 1)
    return head + rest.split(FIT_END, 1)[1].split("\n", 1)[1]


def datasheet_cluster(path):
    from boost_jax.planner import load_cluster

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / Path(path).name
        p.write_text(strip_fit(Path(path).read_text()))
        return load_cluster(p)


def fit_block(constants: dict, rows: list[dict], chosen: dict, measured_path) -> str:
    """The cluster file's fitted block: the constants and their provenance in c.fitted."""
    dates = sorted({r["date"] for r in rows})
    path = Path(measured_path).resolve()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    lines = [
        FIT_BEGIN + " (written by `python benchmarks/planner_time_fit.py --write`; it overrides the",
        "    # values above with the constants fitted to the measured steps)",
    ]
    for n, v in constants.items():
        lines.append(f"    c.{n} = {v:.4g}")
    lines.append("    c.fitted = {")
    for n, v in constants.items():
        lines.append(
            f'        "{n}": "{v:.4g}: least squares of the relative step-time error over the {len(rows)} fit "'
        )
        lines.append(
            f'                "rows of {name} ({dates[0]} to {dates[-1]}; leave-one-out RMS '
            f'{100 * chosen["loo_rms"]:.1f}%)",'
        )
    lines += ["    }", FIT_END]
    return "\n".join(lines)


def write_cluster(path, block: str) -> None:
    text = strip_fit(Path(path).read_text())
    marker = "    return c\n"
    if marker not in text:
        raise SystemExit(f"{path}: no `return c` line to put the fitted block before")
    Path(path).write_text(text.replace(marker, block + "\n" + marker, 1))


# ---------------------------------------------------------------- remat picks


def remat_picks(rows: list[dict], cluster) -> list[dict]:
    """Per plan measured under two or more remat policies (the other overrides equal): the measured
    fastest and the planner's pick (its one-device search at that batch, no accumulation, scanned stacks)."""
    from boost_jax.planner import Options, search

    groups: dict = {}
    for r in rows:
        if r["role"] == "unmodelled":
            continue
        rest = {k: v for k, v in r["overrides"].items() if k != "remat.policy"}
        policy = row_config(r).remat.policy
        groups.setdefault((r["config"], r["seq"], r["batch"], json.dumps(rest, sort_keys=True)), {})[policy] = r
    out = []
    for (config, seq, batch, rest), by_policy in groups.items():
        if len(by_policy) < 2:
            continue
        r = next(iter(by_policy.values()))
        cfg = row_config(r)
        res = search(
            cfg,
            cluster,
            1,
            Options(batch=batch, seq=seq, attention=cfg.model.attention, grad_accum=1, top=1, unroll=False),
        )
        pick = res.best_runnable.remat if res.best_runnable else None
        fastest = min(by_policy, key=lambda p: by_policy[p]["step_ms"])
        out.append(
            {
                "config": config,
                "seq": seq,
                "batch": batch,
                "overrides": json.loads(rest),
                "measured_ms": {p: by_policy[p]["step_ms"] for p in by_policy},
                "measured_fastest": fastest,
                "planner_pick": pick,
                "agrees": pick == fastest,
            }
        )
    return out


# ---------------------------------------------------------------- the table


def overrides_text(o: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in o.items()) or "defaults"


def table(report: dict) -> str:
    lines = [
        "| config | seq x batch | overrides | role | measured ms | datasheet ms | file now ms | fitted ms "
        "| fitted / measured | within 15% | planner GB | measured peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ok = abs(r["fitted_error"]) <= TOLERANCE
        peak = "-" if r.get("peak_gb") is None else f"{r['peak_gb']:.1f}"
        lines.append(
            f"| {r['config']} | {r['seq']} x {r['batch']} | {overrides_text(r['overrides'])} | {r['role']} "
            f"| {r['step_ms']:.1f} | {r['datasheet_ms']:.1f} ({r['datasheet_error']:+.0%}) "
            f"| {r['file_ms']:.1f} ({r['file_error']:+.0%}) | {r['fitted_ms']:.1f} "
            f"| {1 + r['fitted_error']:.3f} | {'yes' if ok else 'NO'} | {r['planner_gb']:.1f} | {peak} |"
        )
    return "\n".join(lines)


def picks_table(picks: list[dict]) -> str:
    lines = [
        "| config | seq x batch | overrides | measured ms by remat | measured fastest | planner's pick | agrees |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in picks:
        ms = ", ".join(f"{k} {v:.1f}" for k, v in p["measured_ms"].items())
        lines.append(
            f"| {p['config']} | {p['seq']} x {p['batch']} | {overrides_text(p['overrides'])} | {ms} "
            f"| {p['measured_fastest']} | {p['planner_pick']} | {'yes' if p['agrees'] else 'NO'} |"
        )
    return "\n".join(lines)


def candidates_table(cands: list[dict], chosen: dict) -> str:
    lines = [
        "| constants fitted | values | in-sample max error | leave-one-out RMS | leave-one-out max |",
        "|---|---|---|---|---|",
    ]
    for c in cands:
        if not c["feasible"]:
            lines.append(f"| {', '.join(c['constants'])} | outside the physical range | - | - | - |")
            continue
        vals = ", ".join(f"{n} {v:.3g}" for n, v in constant_values(c["constants"], c["values"]).items())
        mark = " (taken)" if c is chosen else ""
        lines.append(
            f"| {', '.join(c['constants'])}{mark} | {vals} | {c['in_sample_max']:.1%} | {c['loo_rms']:.1%} "
            f"| {c['loo_max']:.1%} |"
        )
    return "\n".join(lines)


def run(measured=MEASURED, cluster_path=CLUSTER, fit: tuple = ()) -> dict:
    """Price every row, fit, and pick remat: the report (JSON-ready)."""
    from boost_jax.planner import load_cluster

    rows = newest(load_rows(measured))
    base = datasheet_cluster(cluster_path)
    now = load_cluster(cluster_path)
    feats = [features(r, base) for r in rows]
    seconds = [r["step_ms"] / 1e3 for r in rows]
    fit_rows = [i for i, r in enumerate(rows) if r["role"] == "fit"]
    cands = candidates(feats, seconds, fit_rows, base)
    if fit:
        bad = [n for n in fit if n not in dict(FITTABLE)]
        if bad:
            raise SystemExit(f"--fit: {bad} are not among {[n for n, _ in FITTABLE]}")
        chosen = next(c for c in cands if tuple(c["constants"]) == tuple(n for n, _ in FITTABLE if n in fit))
        if not chosen["feasible"]:
            raise SystemExit(f"--fit {','.join(fit)}: the least-squares values leave the physical range")
    else:
        chosen = choose(cands)
    constants = constant_values(chosen["constants"], chosen["values"])
    fitted = dataclasses.replace(base, **constants)
    out_rows = []
    for r, feat in zip(rows, feats):
        plan = price(r, fitted)
        linear = predict(feat, base, chosen["constants"], chosen["values"])
        assert abs(plan.step_s - linear) <= 1e-6 * linear, (plan.step_s, linear)
        d, f = price(r, base).step_s, price(r, now).step_s
        out_rows.append(
            {
                **r,
                "datasheet_ms": 1e3 * d,
                "datasheet_error": 1e3 * d / r["step_ms"] - 1,
                "file_ms": 1e3 * f,
                "file_error": 1e3 * f / r["step_ms"] - 1,
                "fitted_ms": 1e3 * plan.step_s,
                "fitted_error": 1e3 * plan.step_s / r["step_ms"] - 1,
                "planner_gb": plan.memory["total"] / 1e9,
                "peak_gb": r["peak_gib"] * 2**30 / 1e9 if "peak_gib" in r else None,
                "parts_ms": {
                    "layers": 1e3 * plan.layer_cost.total * int(row_config(r).model.n_layers),
                    "layers_kept": 1e3 * plan.layer_cost.kept * int(row_config(r).model.n_layers),
                    "layers_recompute": 1e3 * plan.layer_cost.recompute * int(row_config(r).model.n_layers),
                    "embedding_head": 1e3 * plan.rest_cost.total,
                    "optimizer": 1e3 * plan.optimizer_s,
                },
            }
        )
    return {
        "date": datetime.date.today().isoformat(),
        "measured": str(Path(measured).relative_to(ROOT))
        if Path(measured).resolve().is_relative_to(ROOT)
        else str(measured),
        "cluster": base.name,
        "datasheet": {n: getattr(base, n) for n, _ in FITTABLE},
        "file_now": {n: getattr(now, n) for n, _ in FITTABLE},
        "fitted": constants,
        "chosen": chosen,
        "candidates": cands,
        "rows": out_rows,
        "remat_picks": remat_picks(rows, fitted),
        "remat_picks_datasheet": remat_picks(rows, base),
        "tolerance": TOLERANCE,
    }


def failures(report: dict, roles=("fit", "held_out")) -> list[str]:
    """Rows outside TOLERANCE (of `roles`) and remat picks that are not the measured fastest."""
    out = [
        f"{r['config']} {r['seq']}x{r['batch']} {overrides_text(r['overrides'])}: planner {r['fitted_ms']:.1f} ms, "
        f"measured {r['step_ms']:.1f} ({r['fitted_error']:+.1%})"
        for r in report["rows"]
        if r["role"] in roles and abs(r["fitted_error"]) > TOLERANCE
    ]
    out += [
        f"{p['config']} {p['seq']}x{p['batch']}: planner picks remat {p['planner_pick']}, measured fastest "
        f"{p['measured_fastest']}"
        for p in report["remat_picks"]
        if not p["agrees"]
    ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default=str(MEASURED), help="the measured steps (JSON)")
    ap.add_argument("--cluster", default=str(CLUSTER), help="the cluster file whose constants are fitted")
    ap.add_argument("--fit", default="", help="comma list of constants to fit (default: chosen by leave-one-out)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/planner_time_fit.json"), help="write the numbers here")
    ap.add_argument("--markdown", help="also write the tables here")
    ap.add_argument("--write", action="store_true", help="put the fitted constants into the cluster file")
    args = ap.parse_args(argv)
    try:
        report = run(args.measured, args.cluster, tuple(x.strip() for x in args.fit.split(",") if x.strip()))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rows = newest(load_rows(args.measured))
    block = fit_block(report["fitted"], [r for r in rows if r["role"] == "fit"], report["chosen"], args.measured)
    text = (
        f"Measured steps: {report['measured']} ({len(report['rows'])} plans); cluster {report['cluster']} "
        f"({args.cluster}).\n\nCandidate fits (relative least squares over the {sum(r['role'] == 'fit' for r in rows)}"
        f" fit rows; leave-one-out: each row predicted from the others):\n\n"
        + candidates_table(report["candidates"], report["chosen"])
        + "\n\nFitted: "
        + ", ".join(f"{n} = {v:.4g}" for n, v in report["fitted"].items())
        + " (the other constants keep the cluster file's datasheet values: "
        + ", ".join(f"{n} {v:.4g}" for n, v in report["datasheet"].items() if n not in report["fitted"])
        + ")\n\n"
        + table(report)
        + "\n\nRemat picks (the planner's one-device search, no accumulation), fitted constants:\n\n"
        + picks_table(report["remat_picks"])
        + "\n\nWith the datasheet constants:\n\n"
        + picks_table(report["remat_picks_datasheet"])
    )
    fails = failures(report)
    text += "\n\n" + (
        "PASS: every fit and held-out row within 15%, every remat pick the measured fastest."
        if not fails
        else "FAIL: " + "; ".join(fails)
    )
    text += f"\n\nThe cluster file's fitted block ({'written' if args.write else 'paste it, or run with --write'}):\n\n{block}"  # noqa: E501
    print(text)
    if args.write:
        write_cluster(args.cluster, block)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
