"""MLPs built from shardops: the unsharded reference and its data-, tensor-, 2D- and fully
sharded training strategies, each one ``jax.shard_map`` with explicit collectives.

    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=models.seed_sgd(steps_per_epoch))
    state = setup.init(jax.random.key(0))
    state, loss = setup.train_step(state, *setup.place_batch(x, y))
"""

from models._layout import fsdp_spec, gather_tree, shard_tree, tp_plan
from models._mlp import (
    INIT_SCALE,
    SEED_SIZES,
    accuracy,
    cross_entropy_sum,
    init_mlp,
    loss,
    mlp_forward,
)
from models._train import (
    DECAY_RATE,
    DECAY_STEPS,
    INIT_LR,
    STRATEGIES,
    Metrics,
    Setup,
    TrainState,
    build,
    seed_schedule,
    seed_sgd,
)

__all__ = [
    "DECAY_RATE",
    "DECAY_STEPS",
    "INIT_LR",
    "INIT_SCALE",
    "SEED_SIZES",
    "STRATEGIES",
    "Metrics",
    "Setup",
    "TrainState",
    "accuracy",
    "build",
    "cross_entropy_sum",
    "fsdp_spec",
    "gather_tree",
    "init_mlp",
    "loss",
    "mlp_forward",
    "seed_schedule",
    "seed_sgd",
    "shard_tree",
    "tp_plan",
]
