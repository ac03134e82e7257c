"""How a plan's pipeline stages run one accumulation micro-batch: its ticks, layer passes and hand-overs."""

from __future__ import annotations

import dataclasses

from boost_jax.planner.pricing import cost


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a plan's stages run one accumulation micro-batch (unpipelined: one stage, one tick)."""

    stages: int
    microbatches: int  # pipeline micro-batches M (1 unpipelined)
    name: str  # gpipe | circular | 1f1b
    repeats: int  # V: chunks per stage (1 for GPipe)
    stage_remat: str  # remat.pipeline
    ticks: int  # V M + S - 1
    layers_per_stage: int
    layers_per_tick: int  # one chunk: L/(S V)
    runs: int  # layer passes per device per accumulation micro-batch (bubble ticks included)
    handovers: int  # ticks that hand over to the next stage (cost.handover_ticks)
    executed: int  # layer passes a device computes

    @property
    def staged(self) -> bool:
        return self.stage_remat == "stage"

    @property
    def f1b(self) -> bool:
        return self.name == "1f1b"


def schedule_of(layers: int, stages: int, microbatches: int, schedule: str, repeats: int, stage_remat: str) -> Schedule:
    """The schedule a plan runs: unpipelined, one GPipe tick; GPipe, V = 1."""
    microbatches = microbatches if stages > 1 else 1
    if stages == 1:
        schedule, repeats, stage_remat = "gpipe", 1, "none"
    elif schedule == "gpipe":
        repeats = 1
    ticks, per_stage = cost.pipeline_ticks(stages, microbatches, repeats), layers // stages
    per_tick = per_stage // repeats
    runs = ticks * per_tick
    # 1F1B's lockstep ticks run a forward and a backward each: V M + V S + S - 2 of them hand over, and
    # their compute adds up to the V M + S - 1 ticks above (cost.handover_ticks)
    handovers = cost.handover_ticks(stages, microbatches, repeats, schedule)
    # layer passes a device runs: every tick's (bubble ticks compute on nothing), but 1F1B skips the
    # ticks a stage has no item for (its time still waits for them: `step_seconds` counts `runs`)
    executed = repeats * microbatches * per_tick if schedule == "1f1b" else runs
    return Schedule(
        stages, microbatches, schedule, repeats, stage_remat, ticks, per_stage, per_tick, runs, handovers, executed
    )
