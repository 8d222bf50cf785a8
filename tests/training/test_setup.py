"""``Setup``'s names (``models/training/_setup.py``): one word, one meaning. ``setup.strategy`` is
the ``Strategy`` a setup runs (its name is ``setup.strategy.name``); the former names of it,
``setup.layout`` and ``setup.composition``, raise an AttributeError naming the rename."""

import optax
import pytest
from _messages import refused
from _model_checks import mesh_for

import shardops_models as models

SIZES = (48, 64, 24, 10)


def test_setup_strategy_is_the_strategy_and_its_name_is_the_presets():
    setup = models.build("2d", mesh_for({"data": 4, "model": 2}), sizes=SIZES,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    assert setup.strategy is models.STRATEGIES["2d"]
    assert setup.strategy.name == "2d" and setup.strategy.batch_axes == ("data",)
    # Messages print the name, not the Strategy's repr.
    with refused(ValueError, argument="batch size 6", got="over the 4 devices",
                 expected="mesh axes ('data',) (strategy '2d')", fix="multiple of 4"):  # fmt: skip
        setup.check_batch_size(6)


@pytest.mark.parametrize("old", ["layout", "composition"])
def test_former_names_of_setup_strategy_are_refused_with_the_rename(old):
    """Code written against ``setup.layout`` or ``setup.composition`` fails at once, naming
    ``setup.strategy``, rather than a second name for one thing living on."""
    setup = models.build("ref", sizes=SIZES, optimizer=optax.sgd(0.1))
    with refused(AttributeError, argument=f"setup.{old}", got="is gone",
                 expected="now setup.strategy (the Strategy)",
                 fix="its name is setup.strategy.name"):  # fmt: skip
        getattr(setup, old)
    assert not hasattr(setup, old)
