"""The one place a run config becomes programs: mesh, strategy, abstract state, the jitted steps.

    built = build(cfg)                  # validated; nothing is allocated
    state = built.init_state()          # or restored into built.spec.abstract (runtime/checkpoints/store.py)
    state, metrics = built.train_step(state, batch)     # batch in built.batch_sharding
    compiled = built.lower_train().compile()            # the same program, from abstract shapes

The trainer, evaluate, generate, export, the tools (comm report, shardings, the planner's
`--verify`), the benchmarks and the tests all build through here, so what a tool reports or a test
checks is the program the trainer runs. The steps carry their mesh and strategy (runtime/step.py):
they compile alike wherever they are traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax import xla_gpu_flags
from boost_jax.data import load_tokenizer
from boost_jax.kernels import platform
from boost_jax.model import autos, model_from_config
from boost_jax.model.transformer import split_widths
from boost_jax.parallel.mesh import BATCH_AXES, ONE_DEVICE, make_mesh
from boost_jax.parallel.rules import Strategy
from boost_jax.parallel.strategies import get_strategy
from boost_jax.runtime.checkpoints.store import read_newest, restore
from boost_jax.runtime.optim import make_optimizer
from boost_jax.runtime.state import StateSpec, init_state, state_spec
from boost_jax.runtime.step import bind, make_eval_step, make_train_step, next_token_loss
from boost_jax.validate import check_mesh, validate


@dataclasses.dataclass
class Built:
    cfg: object  # the config as built: every `auto` resolved for this mesh (model/autos.py)
    mesh: Mesh
    strategy: Strategy
    tx: object  # the optax optimizer
    schedule: object  # step -> learning rate
    spec: StateSpec  # abstract state, its shardings, the model's graph definition
    train_step: object  # jitted (state, batch [grad_accum, micro_batch, T+1]) -> (state, metrics); state donated
    batch_sharding: NamedSharding
    eval_step: object  # jitted (params, eval batch) -> per slice (loss sum, targets, tokens); runtime/step.py
    eval_sharding: NamedSharding
    autos: dict = dataclasses.field(default_factory=dict)  # {field: value} each `auto` resolved to (model/autos.py)

    def _abstract(self, rows: tuple, sharding):
        spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)  # noqa: E731
        tokens = spec(rows + (self.cfg.train.seq_len + 1,))
        batching = self.cfg.data.batching
        if batching == "stream":
            return tokens
        if batching == "document":
            return {"tokens": tokens, "lengths": spec(rows)}
        return {"tokens": tokens, "segments": tokens, "positions": tokens}

    def abstract_batch(self):
        """The train step's batch as shapes: tokens [grad_accum, micro_batch, T+1], or for
        data.batching packed/document the dict boost_jax/model/batch.py describes."""
        t = self.cfg.train
        return self._abstract((t.grad_accum, t.global_batch // t.grad_accum), self.batch_sharding)

    def abstract_eval_batch(self):
        """The eval step's batch as shapes: its dict of documents, or for stream batches tokens
        [global_batch, T+1] with the rows that count (runtime/evaluation.py pads a last, partial batch)."""
        rows = (self.cfg.train.global_batch,)
        batch = self._abstract(rows, self.eval_sharding)
        if self.cfg.data.batching != "stream":
            return batch
        return {"tokens": batch, "rows": jax.ShapeDtypeStruct(rows, jnp.bool_, sharding=self.eval_sharding)}

    def lower_train(self):
        """The train step lowered from abstract shapes (`.compile()` it to read HLO and memory)."""
        return self.train_step.lower(self.spec.abstract, self.abstract_batch())

    def lower_eval(self):
        """The eval step lowered from abstract shapes."""
        return self.eval_step.lower(self.spec.abstract["params"], self.abstract_eval_batch())

    def init_state(self) -> dict:
        return init_state(self.cfg, self.tx, self.spec)

    def bind(self, fn):
        """`fn` traced under this build's rules wherever it is traced (as the steps are). Bind the
        outermost function: a bound function sets the full strategy's rules, also inside an island."""
        return bind(fn, self.mesh, self.strategy)

    def loss_fn(self, with_z_loss: bool = True):
        """(params, tokens [B, T+1]) -> mean loss, bound to this mesh and strategy like the steps."""
        graphdef = self.spec.graphdef
        return self.bind(lambda params, tokens: next_token_loss(graphdef, params, tokens, with_z_loss))


def to_global(batch, sharding):
    """This process's rows of a batch (an array or a dict of them) as the global arrays of `sharding`."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def build(cfg, devices=None, optimizer=None, *, validated: bool = False) -> Built:
    """Validate `cfg` (unless the caller just did: `validated`), lay its mesh over `devices` (default:
    every device, or parallel.num_devices of them) and build the abstract state and the jitted train
    and eval steps. `optimizer`: (optax transformation, lr schedule) in place of the config's AdamW
    (tests use plain SGD)."""
    if not validated:
        validate(cfg)
    mesh = make_mesh(cfg.parallel, devices)
    picks = autos.chosen(cfg, mesh)  # what the `auto` fields resolve to for these devices and this mesh
    cfg = autos.apply(cfg, picks)
    check_mesh(cfg, mesh)
    strategy = get_strategy(cfg.parallel)
    tx, schedule = optimizer or make_optimizer(cfg.train)
    with platform.target(mesh):  # the model's dtype and kernels follow the mesh's devices
        spec = state_spec(cfg, tx, mesh, strategy)
    t = cfg.train
    # A GPU step carries the GPU XLA flags itself, wherever it is compiled (deviceless included), and
    # runs its GEMMs on cuBLAS where Triton's tiles cannot split the model's widths (gemm_options).
    options = (
        xla_gpu_flags.accepted(
            {**xla_gpu_flags.compiler_options(), **xla_gpu_flags.gemm_options(split_widths(cfg.model))},
            mesh.devices.flat[0],
        )
        if platform.of(mesh.devices.flat[0]) == "gpu" and cfg.xla_gpu_flags
        else None
    )
    batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
    train_step = jax.jit(
        make_train_step(
            spec.graphdef,
            tx,
            schedule,
            mesh,
            strategy,
            jax.tree.map(lambda s: s.spec, spec.shardings["params"]),
            spec.pipeline,
            spec.casts,
        ),
        donate_argnums=0,
        in_shardings=(spec.shardings, batch_sharding),
        out_shardings=(spec.shardings, None),
        compiler_options=options,
    )
    eval_sharding = NamedSharding(mesh, P(BATCH_AXES))
    eval_step = jax.jit(
        make_eval_step(spec.graphdef, t.eval_microbatches or t.grad_accum, mesh, strategy),
        in_shardings=(spec.shardings["params"], eval_sharding),
        compiler_options=options,
    )
    return Built(cfg, mesh, strategy, tx, schedule, spec, train_step, batch_sharding, eval_step, eval_sharding, picks)


def load_model(checkpoint: str):
    """(model with a checkpoint's parameters on one device, the run's config, its tokenizer), from a
    run dir, its checkpoints/ dir or one step dir: generate and export sample and write from it. Only
    the parameters are read; damaged or non-finite weights are refused (CheckpointError). The model
    is built unplaced (no mesh), so it runs outside any rules, e.g. step by step with a KV cache."""
    from flax import nnx

    def read(cfg, root, step):
        cfg.parallel.update(ONE_DEVICE)  # whatever mesh saved it: the abstract target carries the sharding
        cfg.remat.pipeline = "none"  # stage remat needs stages
        built = build(cfg, jax.devices()[:1])
        return built.cfg, restore(
            root,
            {"params": built.spec.abstract["params"]},
            step=step,
            hint="--checkpoint DIR/STEP",
            field="--checkpoint",
        ).state["params"]

    cfg, params = read_newest(checkpoint, read)  # a step rotated away by a running trainer: the newest
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_from_config(cfg)))
    return nnx.merge(graphdef, params), cfg, load_tokenizer(cfg.data.tokenizer)
