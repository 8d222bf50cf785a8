"""Models built from shardops and the strategies that train them, for any model.

    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=models.seed_sgd(steps_per_epoch))          # the seed's MLP
    setup = models.build("fsdp_tp", mesh, model=models.Gpt(), optimizer=optax.adam(3e-4))
    setup = models.build("hsdp_tp", mesh, model=models.Llama(num_kv_heads=2),
                         optimizer=optax.chain(shardops.clip_by_global_norm(1.0), optax.adamw(3e-4)))
    state = setup.init(jax.random.key(0))
    state, loss = setup.train_step(state, *setup.place_batch(x, y))

A strategy composes a data-axis strategy (dp, fsdp) with a model-axis one (tp, sp) and,
optionally, context parallelism (``"2d+ring"``: the sequence over ``context``); a model
gives its parameters a plan of tensor-parallel roles (``models.strategies.plan``) and writes its forward
once against the layer context (``models.strategies.parallel``).
"""

from shardops_models.networks._lm import PAD_LABEL, check_token_range
from shardops_models.networks._mlp import (
    INIT_SCALE,
    SEED_SIZES,
    accuracy,
    cross_entropy_sum,
    init_mlp,
    loss,
    mlp_forward,
)
from shardops_models.networks.contract import Model, check_model
from shardops_models.networks.gpt import Gpt
from shardops_models.networks.llama import Experts, Llama, SpecialTokens
from shardops_models.networks.mlp import Mlp, tp_plan
from shardops_models.strategies.fsdp import fsdp_spec
from shardops_models.strategies.layout import (
    strategy_named,
    with_context,
    with_experts,
    with_pipeline,
)
from shardops_models.strategies.parallel import STRATEGIES, Parallel, Strategy, strategies_for
from shardops_models.strategies.plan import (
    COLUMN,
    EXPERTS,
    HEAD,
    REPLICATED,
    ROLES,
    ROW,
    VOCAB,
    Role,
    stacked,
)
from shardops_models.strategies.remat import Remat
from shardops_models.training._optimizer import (
    DECAY_RATE,
    DECAY_STEPS,
    INIT_LR,
    seed_schedule,
    seed_sgd,
)
from shardops_models.training._placement import gather_tree, shard_tree
from shardops_models.training._setup import Setup
from shardops_models.training._state import Metrics, TrainState
from shardops_models.training._train import build
from shardops_models.training.locate import locate, locate_non_finite

__all__ = [
    "COLUMN",
    "DECAY_RATE",
    "DECAY_STEPS",
    "EXPERTS",
    "HEAD",
    "INIT_LR",
    "INIT_SCALE",
    "PAD_LABEL",
    "REPLICATED",
    "ROLES",
    "ROW",
    "SEED_SIZES",
    "STRATEGIES",
    "VOCAB",
    "Experts",
    "Gpt",
    "Llama",
    "Metrics",
    "Mlp",
    "Model",
    "Parallel",
    "Remat",
    "Role",
    "Setup",
    "SpecialTokens",
    "Strategy",
    "TrainState",
    "accuracy",
    "build",
    "check_model",
    "check_token_range",
    "cross_entropy_sum",
    "fsdp_spec",
    "gather_tree",
    "init_mlp",
    "locate",
    "locate_non_finite",
    "loss",
    "mlp_forward",
    "seed_schedule",
    "seed_sgd",
    "shard_tree",
    "stacked",
    "strategies_for",
    "strategy_named",
    "tp_plan",
    "with_context",
    "with_experts",
    "with_pipeline",
]
