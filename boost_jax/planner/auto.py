"""parallel.plan=auto: the planner's best runnable plan for a run config on the devices the trainer sees,
and the config that runs it.

The trainer (boost_jax/train.py) calls `plan_run(cfg, devices, device_kind)` before it builds the
step: the cluster is parallel.cluster's file, else the packaged one for the device kind
(DEVICE_CLUSTERS); the search is `python -m boost_jax.plan`'s at the config's batch, sequence length
and attention, every mesh, remat policy, gradient accumulation and pipeline schedule; the plan's
`--config.*` overrides (the ones the CLI prints) are applied to the config after the fields a plan
decides are reset to their defaults. The trainer compiles the pick before it runs it (`fitting_plan`):
where the compiled program's peak per device (memory_analysis) exceeds the device's memory, it says so
in one line and takes the planner's next plan, up to MAX_COMPILES picks. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses

from boost_jax.config import base_config
from boost_jax.errors import ConfigError
from boost_jax.planner.pricing.cluster import Cluster, load_cluster
from boost_jax.planner.pricing.plans import Options, Plan
from boost_jax.planner.search import search

# (a substring of jax's device_kind, the packaged cluster file for it), first match wins
DEVICE_CLUSTERS = (("H100", "clusters/h100_8x"), ("A100", "clusters/a100_4x"))
# the config fields a plan decides: reset to base_config()'s values before its overrides apply
DECIDES = (
    "parallel.pipeline",
    "parallel.microbatches",
    "parallel.pipeline_schedule",
    "parallel.pipeline_repeats",
    "parallel.data",
    "parallel.fsdp",
    "parallel.context",
    "parallel.context_attention",
    "parallel.context_kv",
    "parallel.tensor",
    "parallel.strategy",
    "parallel.sequence_parallel",
    "parallel.linear_partition",
    "remat.policy",
    "remat.pipeline",
    "train.grad_accum",
)
GB = 1e9
MAX_COMPILES = 4  # picks parallel.plan=auto compiles before it gives up (each compile takes a while at 7B)


@dataclasses.dataclass
class AutoPlan:
    plan: Plan
    cluster: Cluster
    cluster_file: str
    devices: int
    considered: int
    seconds: float

    def describe(self) -> str:
        """One line: the pick, its predicted step time and memory, and the search."""
        p, m = self.plan, self.plan.mesh
        parts = [
            f"mesh {m} (pipeline x data x fsdp x tensor{' c context' if m.context > 1 else ''})",
            f"strategy {p.strategy}" + (" + sequence parallel" if p.sequence_parallel else ""),
            f"remat {p.remat_label}",
            f"grad_accum {p.grad_accum}",
        ]
        if m.pipeline > 1:
            parts.append(
                f"{p.schedule}{f' V{p.repeats}' if p.schedule == 'circular' else ''} M{p.microbatches}"
                + (" + stage remat" if p.stage_remat == "stage" else "")
            )
        if m.context > 1:
            parts.append(f"context {p.context_attention} / {p.context_kv}")
        return (
            f"parallel.plan=auto: {', '.join(parts)}; the planner predicts {1e3 * p.step_s:.3g} ms per step and "
            f"{p.memory['total'] / GB:.3g} GB per GPU on {self.devices} x {self.cluster.name} "
            f"({self.cluster_file}; the best runnable of {self.considered:,} plans, searched in {self.seconds:.1f} s)"
        )


def cluster_file(cfg, device_kind: str) -> str:
    """parallel.cluster, else the packaged cluster of the device kind (a ConfigError naming the field
    where neither is known)."""
    if cfg.parallel.cluster:
        return str(cfg.parallel.cluster)
    for part, name in DEVICE_CLUSTERS:
        if part.lower() in device_kind.lower():
            return name
    raise ConfigError(
        f"config field `parallel.cluster`: parallel.plan=auto has no cluster file for device kind "
        f"{device_kind!r}; name one, e.g. --config.parallel.cluster=clusters/h100_8x (known kinds: "
        f"{', '.join(k for k, _ in DEVICE_CLUSTERS)})"
    )


def plan_run(cfg, devices: int, device_kind: str, exclude=frozenset()) -> tuple[object, AutoPlan]:
    """(the explicit config that runs the planner's best runnable plan, the AutoPlan) for `devices` devices of
    `device_kind`, other than the plans whose overrides are in `exclude`. A ConfigError (one line) when no
    plan the trainer runs fits."""
    path = cluster_file(cfg, device_kind)
    try:
        cluster = load_cluster(path)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"config field `parallel.cluster`: {str(e).replace('--cluster: ', '')}") from None
    t = cfg.train
    opts = Options(
        batch=int(t.global_batch),
        seq=int(t.seq_len),
        attention=str(cfg.model.attention),
        top=1,
        exclude=frozenset(exclude),
    )
    try:
        res = search(cfg, cluster, devices, opts)
    except ValueError as e:
        raise ConfigError(f"config field `parallel.plan`: auto: {e}") from None
    where = f"{devices} x {cluster.name} ({cluster.usable_hbm / GB:.0f} GB usable per GPU)"
    if res.best_runnable is None:
        if not res.plans and res.smallest is not None:
            s = res.smallest
            raise ConfigError(
                f"config field `parallel.plan`: auto: no plan for {cfg.name} at batch {t.global_batch} x "
                f"seq {t.seq_len} fits {where}; the smallest needs {s.memory['total'] / GB:.1f} GB "
                f"(mesh {s.mesh}, remat {s.remat}): use more devices or lower train.global_batch"
            )
        raise ConfigError(
            f"config field `parallel.plan`: auto: no plan the trainer can run for {cfg.name} fits {where}"
            + (f" (the best fitting one: {res.plans[0].runnable})" if res.plans else "")
            + "; set the mesh yourself with parallel.plan=explicit"
        )
    auto = AutoPlan(res.best_runnable, cluster, path, devices, res.considered, res.seconds)
    return apply(cfg, res.best_runnable.overrides), auto


def short(plan: Plan) -> str:
    """A plan in a few words: mesh, strategy, remat, accumulation (and pipeline schedule)."""
    m = plan.mesh
    pipe = f", {plan.schedule} M{plan.microbatches}" if m.pipeline > 1 else ""
    return f"mesh {m}, {plan.strategy}, remat {plan.remat_label}, grad_accum {plan.grad_accum}{pipe}"


def fitting_plan(cfg, devices: int, device_kind: str, peak, memory, say, tries: int = 0):
    """(config, AutoPlan, what `peak` returned besides the bytes) of the planner's best runnable plan whose
    compiled train step fits the device (`first_that_fits`). `peak(config)`: (the compiled step's peak
    bytes per device, anything the caller keeps, e.g. the compiled program); `memory(cluster)`: (the
    device's bytes, where that number comes from)."""
    autos: dict = {}

    def pick(exclude):
        try:
            run, auto = plan_run(cfg, devices, device_kind, exclude)
        except ConfigError:
            if not exclude:
                raise
            return None  # no plan left
        autos[auto.plan.overrides] = auto
        return auto.plan, auto.describe(), run

    def fits(run, plan):
        got, kept = peak(run)
        return (got, *memory(autos[plan.overrides].cluster), kept)

    t = cfg.train
    run, plan, kept = first_that_fits(pick, fits, say, f"{cfg.name} at batch {t.global_batch} x seq {t.seq_len}", tries)
    return run, autos[plan.overrides], kept


TRAINER_FIX = "use more devices, lower train.global_batch, or set the mesh yourself with parallel.plan=explicit"


def first_that_fits(
    pick, fits, say, what: str, tries: int = 0, label: str = "parallel.plan=auto", fix: str = TRAINER_FIX
):
    """(config, Plan, kept) of the first of the planner's ranked plans whose compiled train step fits the
    device: `pick(exclude)`: (the best plan the trainer runs other than those whose overrides are in
    `exclude`, its line, its config) or None when none is left; `fits(config, plan)`: (compiled peak
    bytes per device, the device's bytes, where that comes from, anything the caller keeps). Each pick is
    said in its line (later ones as `parallel.plan=auto: next, ...`) with its flags; one over the device
    is named in one line with both numbers and the next plan is taken; a ConfigError (one line, with the
    fix) when none of `tries` (0: MAX_COMPILES) picks fits. `what`: the model and shape, for it; `label`:
    what the lines start with (each pick's line starts with it too); `fix`: the error's advice."""
    tried: list = []
    over = ""
    for _ in range(tries or MAX_COMPILES):
        got = pick(frozenset(p.overrides for p in tried))
        if got is None:
            break
        plan, line, run = got
        say(line.replace(f"{label}: ", f"{label}: next, ", 1) if tried else line)
        say(f"  (explicitly: {plan.overrides})")
        need, limit, source, kept = fits(run, plan)
        if need <= limit:
            return run, plan, kept
        over = f"{limit / GB:.3g} GB per device ({source})"
        say(
            f"{label}: the pick ({short(plan)}) does not fit: its compiled train step needs "
            f"{need / GB:.3g} GB per device, the device has {limit / GB:.3g} GB ({source}); taking the planner's "
            "next plan"
        )
        tried.append(plan)
    raise ConfigError(
        f"config field `parallel.plan`: auto: none of the planner's {len(tried)} best plans for {what} compiles "
        f"within {over} (the last: {short(tried[-1])}); {fix}"
    )


def apply(cfg, overrides: str):
    """A copy of cfg with the fields a plan decides reset to their defaults and the plan's
    `--config.KEY=VALUE` overrides set (each value as the field's type): the explicit config of the
    plan (parallel.plan=explicit, parallel.cluster and parallel.device_memory_gb unset), what the run
    records in its config.json."""

    out = cfg.copy_and_resolve_references()
    out.parallel.plan, out.parallel.cluster, out.parallel.device_memory_gb = "explicit", "", 0.0
    defaults = base_config()
    for key in DECIDES:
        section, name = key.split(".")
        out[section][name] = defaults[section][name]
    for flag in overrides.split():
        key, _, value = flag.removeprefix("--config.").partition("=")
        *path, name = key.split(".")
        node = out
        for part in path:
            node = node[part]
        old = node[name]
        if value in ("true", "false") and (isinstance(old, bool) or old == "auto"):  # an `auto | bool` field
            with out.ignore_type():
                node[name] = value == "true"
            continue
        node[name] = type(old)(value) if isinstance(old, (int, float, str)) else value
    return out
