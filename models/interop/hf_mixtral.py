"""Hugging Face Mixtral checkpoints in and out of ``models.Llama(experts=...)``, under any
strategy and mesh, expert-parallel ones included.

    ckpt = interop.HfMixtral("path/to/mixtral")          # config.json + *.safetensors
    setup = models.build("2d+ep", mesh, model=ckpt.model(strategy="2d+ep"),
                         optimizer=optax.adamw(1e-5))    # ep: capacity E / k (drops nothing)
    state = ckpt.load(setup)                              # each process reads only its slices
    ...
    interop.save_hf_mixtral("out/", setup, state)        # MixtralForCausalLM.from_pretrained

Everything ``HfLlama`` does (``hf_llama``'s docstring: the files, reading each device's block
straight from them, tied heads, padding, sharded saves) it does for Mixtral, whose blocks hold
a mixture of experts in place of the MLP. The attention, norms, embedding and head are
Llama's (``NAMES``); each block's MLP is replaced by (``E`` experts of hidden size ``F``):

======================================  =======================================================  ==========
shardops parameter                      transformers tensor (``model.layers.{l}.``…)               layout
======================================  =======================================================  ==========
``blocks.moe.router[L, D, E]``          ``block_sparse_moe.gate.weight[E, D]``                   stacked, ᵀ
``blocks.moe.gate[L, E, D, F]``         ``block_sparse_moe.experts.{e}.w1.weight[F, D]``          stacked, ᵀ
``blocks.moe.up[L, E, D, F]``           ``block_sparse_moe.experts.{e}.w3.weight[F, D]``          stacked, ᵀ
``blocks.moe.down[L, E, F, D]``         ``block_sparse_moe.experts.{e}.w2.weight[D, F]``          stacked, ᵀ
======================================  =======================================================  ==========

(the names ``save_pretrained`` writes; transformers ≥ 5 fuses ``w1`` and ``w3`` into
``gate_up_proj`` in memory and splits them back when saving.) The routing is Mixtral's: a
softmax over the ``E`` router logits, the top ``k`` renormalised over the ``k``.

**Capacity.** transformers' Mixtral is dropless: every token reaches its ``k`` experts.
``mixtral_from_config`` (and ``HfMixtral.model``) therefore builds a dropless model,
``capacity_factor=None`` (each expert computes exactly its tokens: sorted by expert, grouped
matmuls), whose logits are transformers'. Expert parallelism cannot split dropless experts
(``models.strategies.expert``): given ``strategy=`` with ep (``"2d+ep"``), the model takes the
capacity path at ``capacity_factor = E / k`` instead, so that ``C = min(S, ceil(capacity_factor
· S · k / E)) = S``: still no choice dropped and transformers' logits, at the cost of buffers
that hold a whole sequence per expert. To train cheaper, pass ``capacity_factor=`` (e.g. 1.25:
the choices beyond ``C`` dropped), build the setup from that model and load with
``load(setup, experts="setup")``: by default ``load`` refuses a setup whose capacity drops
choices or whose loss weights are not the checkpoint's, naming each field.

**Config.** The Llama fields map as ``llama_from_config`` maps them (its refusals too), with
Mixtral's defaults for a field config.json leaves out (``DEFAULTS``: ``MixtralConfig()``'s
``d_ff`` 14336, 8 KV heads, context 131072, ``rms_norm_eps`` 1e-5, θ 10⁶, 8 experts, k 2,
``router_aux_loss_coef`` 0.001). ``num_local_experts`` → ``Experts.num_experts``,
``num_experts_per_tok`` → ``k``. transformers' auxiliary loss pools the router statistics
of all ``L`` layers and counts each of a token's ``k`` choices as a whole token:
``coef · E · Σ_e (n_e / (T·L)) · p̄_e``; ours sums a balance term over the layers, each
``E · Σ_e (n_e / (T·k)) · p̄_e``. ``load_balance_weight = router_aux_loss_coef · k / L`` makes
the two equal when the layers route alike (exactly so with one layer), and is what
``hf_config`` inverts when saving. Mixtral has no z-loss: ``z_loss_weight`` is 0. Each of
these can be overridden (``capacity_factor=``, ``load_balance_weight=``, ``z_loss_weight=``,
``load_balance=``). Refused, naming the field (``UnsupportedConfig``): a non-zero
``router_jitter_noise`` (transformers multiplies the router's input by noise in training), a
``sliding_window`` shorter than the context (our attention sees the whole sequence; a window
at least the context never masks anything).
"""

from __future__ import annotations

import dataclasses
import os

from shardops_models.interop import hf_llama  # Llama's NAMES, DEFAULTS and hf_config
from shardops_models.interop._hf_config import UnsupportedConfig, _config_dict, _llama_fields
from shardops_models.interop._hf_reader import HfLlama
from shardops_models.interop._hf_writer import _save_hf
from shardops_models.networks.llama import Experts, Llama
from shardops_models.strategies.layout import Strategy, strategy_named
from shardops_models.training._setup import Setup

_MOE = "model.layers.{l}.block_sparse_moe."
# shardops path → (transformers name, transposed): Llama's, the MLP replaced by the experts.
NAMES: dict[tuple[str, ...], tuple[str, bool]] = {
    **{key: value for key, value in hf_llama.NAMES.items() if key[:2] != ("blocks", "mlp")},
    ("blocks", "moe", "router"): (_MOE + "gate.weight", True),
    ("blocks", "moe", "gate"): (_MOE + "experts.{e}.w1.weight", True),
    ("blocks", "moe", "up"): (_MOE + "experts.{e}.w3.weight", True),
    ("blocks", "moe", "down"): (_MOE + "experts.{e}.w2.weight", True),
}

# What transformers' ``MixtralConfig()`` gives a field that config.json leaves out.
DEFAULTS = {
    **hf_llama.DEFAULTS,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
}
# ``Experts`` fields a caller may set over the config's (``mixtral_from_config``'s overrides).
TRAINING = ("capacity_factor", "load_balance", "load_balance_weight", "z_loss_weight")
LOAD_EXPERTS = ("checkpoint", "setup")
"""``HfMixtral.load``'s ``experts``: whose ``TRAINING`` fields the setup's model must have."""


def mixtral_from_config(config: dict | str | os.PathLike, *,
                        strategy: Strategy | str | None = None, **overrides) -> Llama:  # fmt: skip
    """The ``models.Llama(experts=...)`` of a transformers Mixtral config (a dict,
    ``config.json`` or its folder): dropless (``capacity_factor=None``; ``E / k``, which drops
    nothing either, where ``strategy`` has expert parallelism), the load-balance weight
    ``router_aux_loss_coef · k / L``, no z-loss (module docstring). ``strategy``: the
    ``Strategy`` (or preset name) the model will be built under, None for one without ep.
    ``overrides`` replace ``Llama`` fields (``context=``) or the experts' ``TRAINING`` ones
    (``capacity_factor=1.25``). Unsupported fields are an ``UnsupportedConfig`` naming the
    field."""
    config = _config_dict(config)
    if config.get("model_type") != "mixtral":
        raise UnsupportedConfig(
            f"config model_type={config.get('model_type')!r}: HfMixtral loads 'mixtral' "
            f"(MixtralForCausalLM) checkpoints; a 'llama' one loads with interop.HfLlama"
        )
    fields = _llama_fields(config, DEFAULTS)
    training = {k: overrides.pop(k) for k in TRAINING if k in overrides}
    context = overrides.get("context", fields["context"])
    config = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if config.get("router_jitter_noise"):
        raise UnsupportedConfig(
            f"config router_jitter_noise={config['router_jitter_noise']!r} is not supported: "
            f"models.Llama's router takes its input as it is (no multiplicative noise in "
            f"training); set it to 0.0"
        )
    window = config.get("sliding_window")
    if window is not None and window < context:
        raise UnsupportedConfig(
            f"config sliding_window={window!r} is not supported under a context of {context}: "
            f"models.Llama attends to the whole sequence; pass context={window} (a window "
            f"at least the context masks nothing) or set sliding_window to null"
        )
    e, k = config["num_local_experts"], config["num_experts_per_tok"]
    coef = float(config["router_aux_loss_coef"])
    ep = strategy is not None and strategy_named(strategy).ep is not None
    experts = Experts(num_experts=e, k=k, capacity_factor=None, score="softmax",
                      load_balance="global",
                      load_balance_weight=coef * k / fields["num_layers"],
                      z_loss_weight=0.0)  # fmt: skip
    experts = dataclasses.replace(experts.splittable() if ep else experts, **training)
    return Llama(**{**fields, "experts": experts, **overrides})


def hf_config(model: Llama, dtype="float32") -> dict:
    """The transformers ``config.json`` of ``model`` (``MixtralForCausalLM``): Llama's fields,
    the experts', ``router_aux_loss_coef = load_balance_weight · L / k`` (module docstring)."""
    e = model.experts
    config = {k: v for k, v in hf_llama.hf_config(model, dtype).items()
              if k not in ("mlp_bias", "attention_bias", "rope_scaling")}  # fmt: skip
    return {
        **config,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": e.num_experts,
        "num_experts_per_tok": e.k,
        "router_aux_loss_coef": e.load_balance_weight * model.num_layers / e.k,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


class HfMixtral(HfLlama):
    """A transformers Mixtral checkpoint folder, read lazily: ``HfLlama``'s interface
    (``model()``, ``load(setup)``, ``elements_read``, ``tie_embeddings``) for
    ``MixtralForCausalLM`` (module docstring). ``model(strategy=..., **overrides)`` is
    ``mixtral_from_config``'s: dropless, or ``E / k`` under ep. ``load`` refuses a setup
    whose experts' ``TRAINING`` fields (capacity, loss weights) are not the checkpoint's, or,
    with ``experts="setup"``, takes them as the checkpoint's."""

    TABLE = NAMES

    def model(self, *, strategy: Strategy | str | None = None, **overrides) -> Llama:
        """The checkpoint's ``models.Llama(experts=...)``: ``mixtral_from_config(config,
        strategy=strategy, **overrides)``, tied as ``tie_embeddings`` says. Dropless
        (``capacity_factor=None``, transformers' routing); where ``strategy`` (a name or a
        ``Strategy``) has expert parallelism, the capacity ``E / k``, which drops nothing
        either and which ep can split. ``overrides``: ``Llama`` fields (``context=``) or the
        experts' ``TRAINING`` fields (``capacity_factor=1.25``)."""
        return super().model(strategy=strategy, **overrides)

    @staticmethod
    def _from_config(config: dict, **overrides) -> Llama:
        return mixtral_from_config(config, **overrides)

    def _training_fields(self, model: Llama) -> dict:
        fields = super()._training_fields(model)
        if model.experts is not None:
            fields.update({k: getattr(model.experts, k) for k in TRAINING})
        return fields

    def load(self, setup: Setup, *, optimizer_state: bool = True, experts: str = "checkpoint"):
        """``HfLlama.load``, the setup's experts checked first: with ``experts="checkpoint"``
        (the default) its ``TRAINING`` fields must be those of ``model(strategy=...)`` (a
        capacity that drops no choice, the checkpoint's load-balance form and loss weights),
        else a ``ValueError`` naming each field, since a capacity that drops moves the logits
        away from transformers' and other weights change what the model trains on;
        ``experts="setup"`` takes the setup's (fine-tuning at ``capacity_factor=1.25``, say)."""
        if experts not in LOAD_EXPERTS:
            raise ValueError(f"HfMixtral.load: experts must be one of {LOAD_EXPERTS}; got "
                             f"{experts!r}")  # fmt: skip
        model = setup.model
        if experts == "checkpoint" and isinstance(model, Llama) and model.experts is not None:
            own = self.model(strategy=setup.strategy).experts
            if own.num_experts == model.experts.num_experts and own.k == model.experts.k:
                self._check_experts(own, model.experts)  # (other experts: HfLlama.load's error)
        return super().load(setup, optimizer_state=optimizer_state)

    def _check_experts(self, own: Experts, setup: Experts) -> None:
        """A ``ValueError`` naming each ``TRAINING`` field of ``setup`` that is not the
        checkpoint's ``own`` (a capacity is the checkpoint's if it drops no choice either)."""
        drops = [cf is not None and cf < e.num_experts / e.k
                 for e, cf in ((own, own.capacity_factor), (setup, setup.capacity_factor))]  # fmt: skip
        differ = [f"capacity_factor={setup.capacity_factor!r} (below E / k = "
                  f"{setup.num_experts / setup.k:g}: the choices beyond an expert's slots are "
                  f"dropped)"] if drops[1] != drops[0] else []  # fmt: skip
        differ += [f"{f}={getattr(setup, f)!r} (the checkpoint's: {getattr(own, f)!r})"
                   for f in TRAINING[1:] if getattr(setup, f) != getattr(own, f)]  # fmt: skip
        if differ:
            raise ValueError(
                f"HfMixtral.load: the setup's experts are not the checkpoint's ({self.directory}):"
                f" {'; '.join(differ)}. The model would not compute transformers' logits or "
                f"would train another objective. Build the setup with "
                f"ckpt.model(strategy=...), or pass load(setup, experts='setup') to take the "
                f"setup's deliberately"
            )


def save_hf_mixtral(directory: str | os.PathLike, setup: Setup, state, *,
                    max_shard_bytes: int | None = None, dtype=None) -> list[str]:  # fmt: skip
    """Write ``state`` (a ``TrainState`` or the params, laid out by ``setup``, a
    ``models.Llama`` with softmax-routed experts) as a transformers Mixtral checkpoint in
    ``directory``: ``save_hf_llama``'s files, folder and arguments (``max_shard_bytes``,
    ``dtype``), the experts named as ``NAMES`` gives. The capacity and the z-loss are how
    shardops trains, not part of the function: transformers runs the model dropless (and
    ``HfMixtral.model`` reads it back dropless, or at ``E / k`` under ep). Returns
    the files written (process 0; ``[]`` elsewhere)."""
    model = setup.model
    if not isinstance(model, Llama) or model.experts is None:
        raise TypeError(f"save_hf_mixtral needs a setup of models.Llama with experts; got "
                        f"{getattr(model, 'name', type(model))} (a Llama without experts: "
                        f"interop.save_hf_llama)")  # fmt: skip
    if model.experts.score != "softmax":
        raise ValueError(f"save_hf_mixtral: experts score={model.experts.score!r}: Mixtral's "
                         f"router is a softmax (score='softmax'); a {model.experts.score} "
                         f"router cannot be saved as one")  # fmt: skip
    return _save_hf(directory, setup, state, NAMES, hf_config, "save_hf_mixtral",
                   max_shard_bytes=max_shard_bytes, dtype=dtype)  # fmt: skip
