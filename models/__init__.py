"""Models built from shardops and the strategies that train them, for any model.

    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=models.seed_sgd(steps_per_epoch))          # the seed's MLP
    setup = models.build("fsdp_tp", mesh, model=models.Gpt(), optimizer=optax.adam(3e-4))
    state = setup.init(jax.random.key(0))
    state, loss = setup.train_step(state, *setup.place_batch(x, y))

A strategy composes a data-axis strategy (dp, fsdp) with a model-axis one (tp, sp); a model
gives its parameters a plan of tensor-parallel roles (``models.plan``) and writes its forward
once against the layer context (``models.parallel``).
"""

from shardops_models._layout import fsdp_spec, gather_tree, shard_tree
from shardops_models._mlp import (
    INIT_SCALE,
    SEED_SIZES,
    accuracy,
    cross_entropy_sum,
    init_mlp,
    loss,
    mlp_forward,
)
from shardops_models._train import (
    DECAY_RATE,
    DECAY_STEPS,
    INIT_LR,
    Metrics,
    Setup,
    TrainState,
    build,
    seed_schedule,
    seed_sgd,
)
from shardops_models.gpt import Gpt
from shardops_models.locate import locate
from shardops_models.mlp import Mlp, tp_plan
from shardops_models.parallel import STRATEGIES, Parallel, Strategy, strategies_for
from shardops_models.plan import COLUMN, HEAD, REPLICATED, ROLES, ROW, VOCAB

__all__ = [
    "COLUMN",
    "DECAY_RATE",
    "DECAY_STEPS",
    "HEAD",
    "INIT_LR",
    "INIT_SCALE",
    "REPLICATED",
    "ROLES",
    "ROW",
    "SEED_SIZES",
    "STRATEGIES",
    "VOCAB",
    "Gpt",
    "Metrics",
    "Mlp",
    "Parallel",
    "Setup",
    "Strategy",
    "TrainState",
    "accuracy",
    "build",
    "cross_entropy_sum",
    "fsdp_spec",
    "gather_tree",
    "init_mlp",
    "locate",
    "loss",
    "mlp_forward",
    "seed_schedule",
    "seed_sgd",
    "shard_tree",
    "strategies_for",
    "tp_plan",
]
