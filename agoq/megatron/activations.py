"""Apply an activation policy to agoq's layers at model build, and account for saved bytes.

``ActivationStorage`` travels in the layer spec (``agoq_layer_spec(..., policy=, schedule=, save_paths=)``,
``params["agoq_storage"]``): a resolver shared by every layer. Each ``AgoqTransformerLayer``
(agoq.megatron.transformer_layer) calls ``resolve(position)`` in its ``__init__``, before Megatron builds
its submodules: the layer's position (global layer index, pipeline rank, virtual stage) resolves the
policy per role, and the storage rule of ``agoq.plan.storage`` turns that into what each module stores.
The layer then passes each module its format, counter key, counter, host paths and recompute role as
constructor arguments (``ModuleSpec.params``), and the recompute hand-offs (norm -> QKV / fc1, SwiGLU ->
fc2) as ``Handoff`` objects owned by the layer and the MLP.

Accounting, two views:
- ``ActivationStorage.counter`` (``SavedBytesCounter``): exact bytes agoq packs, per (layer, role);
  equal to ``agoq.plan.storage.agoq_bytes`` (the planner's formula).
- ``SavedTensorMeter``: every tensor saved for backward inside the metered region that agoq did not
  replace (Megatron's saves: attention internals, bf16 roles), de-duplicated by storage, parameters
  excluded. "Bytes held for backward" = meter bytes + counter bytes.

Seam card
---------
Touches: the local GPT layer spec (``TransformerLayerSubmodules``, ``SelfAttentionSubmodules``,
  ``MLPSubmodules``, ``spec.module``, ``spec.params``: substitution in ``with_agoq_modules``);
  ``TransformerLayer`` submodule attribute names (``input_layernorm``, ``pre_mlp_layernorm``,
  ``self_attention.linear_qkv/linear_proj``, ``mlp.linear_fc1/linear_fc2``: read by ``agoq_modules``).
Why: the policy is per (layer, role); the layer is the first place that knows its global index.
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_activations.py``, ``tests/megatron/test_activations_pp.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from agoq.megatron.layers import AgoqRMSNorm, _AgoqLinearMixin
from agoq.megatron.mlp import AgoqMLP
from agoq.megatron.sites import LayerPosition
from agoq.ops.saved_act import SavedBytesCounter, SavePaths
from agoq.plan.storage import LayerStorage, layer_storage
from agoq.policy import LAYER_ROLES, PolicySpec, ScheduleInfo

__all__ = ["ActivationStorage", "SavedTensorMeter", "storage_table", "agoq_modules", "with_agoq_modules"]


@dataclass(frozen=True, eq=False)
class ActivationStorage:
    """The resolver the layer spec carries (``params["agoq_storage"]``, shared by every layer): the policy,
    the schedule it is resolved under, the model's byte counter and host paths. Each
    ``AgoqTransformerLayer`` calls ``resolve`` in its ``__init__`` with its own position and passes the
    result to its modules' constructors; ``layers`` records what each built layer stores."""

    policy: PolicySpec
    schedule: ScheduleInfo | None
    counter: SavedBytesCounter = field(default_factory=SavedBytesCounter)
    layers: dict[int, LayerStorage] = field(default_factory=dict)  # filled as layers are built
    paths: SavePaths = field(default_factory=SavePaths)  # host paths of the saved-activation code

    def __deepcopy__(self, memo):  # one storage object per model, even if the spec is deep-copied
        return self

    def resolve(self, position: LayerPosition) -> LayerStorage:
        """What the layer at ``position`` stores per role (the storage rule of ``agoq.plan.storage``)."""
        if self.schedule is not None and (self.schedule.pp_size, self.schedule.vp_size) != (
            position.pp_size, position.vp_size,
        ):
            raise ValueError(
                f"agoq_layer_spec got schedule pp_size={self.schedule.pp_size}, vp_size={self.schedule.vp_size} "
                f"but the model runs pp_size={position.pp_size}, vp_size={position.vp_size}; build the "
                "ScheduleInfo from the same layout"
            )
        storage = layer_storage(self.policy, position.site, self.schedule)
        self.layers[storage.layer_idx] = storage
        return storage


def agoq_modules(layer) -> dict[str, torch.nn.Module]:
    """The agoq modules of a built layer by name; raises unless the layer was built from agoq's spec."""
    attn, mlp = layer.self_attention, layer.mlp
    mods = {
        "input_layernorm": layer.input_layernorm, "pre_mlp_layernorm": layer.pre_mlp_layernorm,
        "linear_qkv": attn.linear_qkv, "linear_proj": attn.linear_proj, "mlp": mlp,
        "linear_fc1": getattr(mlp, "linear_fc1", None), "linear_fc2": getattr(mlp, "linear_fc2", None),
    }
    wanted = {"input_layernorm": AgoqRMSNorm, "pre_mlp_layernorm": AgoqRMSNorm, "mlp": AgoqMLP}
    wrong = [name for name, mod in mods.items() if not isinstance(mod, wanted.get(name, _AgoqLinearMixin))]
    if wrong:
        raise ValueError(
            f"layer {layer.layer_number}: {wrong} are not agoq modules; build the model with "
            "agoq.megatron.model.agoq_layer_spec(..., policy=... or compute=...) so every saved activation "
            "and FP8 linear has an owner"
        )
    return mods


def storage_table(storage: ActivationStorage) -> str:
    """Fixed-width table of what this rank's layers store, one line per run of identical layers."""
    roles = list(LAYER_ROLES)
    rows = []
    for idx in sorted(storage.layers):
        cells = [storage.layers[idx].roles[r].describe() for r in roles]
        if rows and rows[-1][2] == cells and rows[-1][1] == idx - 1:
            rows[-1][1] = idx
        else:
            rows.append([idx, idx, cells])
    header = ["layers", *roles]
    lines = [[str(a) if a == b else f"{a}-{b}", *cells] for a, b, cells in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *lines])


class SavedTensorMeter:
    """Counts the bytes of every tensor saved for backward in its scope (storages de-duplicated,
    parameters excluded), attributed to the layer whose forward is running.

    Tensors agoq replaces inside its own, innermost ``saved_tensors_hooks`` (quantized linear
    inputs, recompute handles) and the quantized copies kept on autograd contexts are *not* seen
    here: they are in ``SavedBytesCounter``. Use: ``with SavedTensorMeter(model_chunks) as meter:``
    run one forward; then ``meter.bytes_by_layer`` / ``meter.total``.
    """

    def __init__(self, modules):
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self._layers = [m for root in modules for m in root.modules() if isinstance(m, TransformerLayer)]
        self._params = {p.data_ptr() for root in modules for p in root.parameters()}
        self._seen: set[int] = set()
        self._current: int | None = None
        self.bytes_by_layer: dict[int | None, int] = {}
        self._stack = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.bytes_by_layer.values())

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._params and ptr not in self._seen and storage.nbytes() > 0:
            self._seen.add(ptr)
            self.bytes_by_layer[self._current] = self.bytes_by_layer.get(self._current, 0) + storage.nbytes()
        return t

    def _enter_layer(self, layer):
        def pre(_module, _args, _kwargs=None):
            self._current = layer.layer_number - 1

        def post(_module, _args, _output):
            self._current = None

        return layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)

    def __enter__(self):
        for layer in self._layers:
            for handle in self._enter_layer(layer):
                self._stack.callback(handle.remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False


def with_agoq_modules(spec):
    """Substitute agoq's modules into a local GPT layer spec (same parameter names; without a resolver in
    ``spec.params`` they run Megatron's code)."""
    from functools import partial

    from megatron.core.transformer.mlp import MLPSubmodules

    from agoq.megatron.layers import AgoqColumnParallelLinear, AgoqRowParallelLinear
    from agoq.megatron.transformer_layer import AgoqTransformerLayer

    if spec.module is AgoqTransformerLayer:
        return spec  # already substituted
    sub = spec.submodules
    sub.input_layernorm = AgoqRMSNorm
    sub.pre_mlp_layernorm = AgoqRMSNorm
    attn = sub.self_attention.submodules
    attn.linear_qkv, attn.linear_proj = AgoqColumnParallelLinear, AgoqRowParallelLinear
    old_mlp = sub.mlp.keywords["submodules"]
    sub.mlp = partial(AgoqMLP.as_mlp_submodule, submodules=MLPSubmodules(
        linear_fc1=AgoqColumnParallelLinear, linear_fc2=AgoqRowParallelLinear,
        activation_func=old_mlp.activation_func))
    spec.module = AgoqTransformerLayer
    return spec


def with_activation_storage(spec, policy, schedule: ScheduleInfo | None, paths: SavePaths | None = None):
    """Substitute agoq's modules into a local GPT layer spec and put an ActivationStorage in its ``params``
    (``paths``: the host paths of the saved-activation code, default :class:`agoq.ops.saved_act.SavePaths`)."""
    from pathlib import Path

    from agoq.policy import load_policy

    if isinstance(policy, (str, Path)):
        policy = load_policy(policy)
    if not isinstance(policy, PolicySpec):
        raise ValueError(f"policy must be an agoq.policy.PolicySpec or a YAML path, got {type(policy).__name__}")
    spec = with_agoq_modules(spec)
    spec.params = {**spec.params, "agoq_storage": ActivationStorage(policy, schedule, paths=paths or SavePaths())}
    return spec


def storage_of(spec) -> ActivationStorage | None:
    """The ActivationStorage a spec from ``agoq_layer_spec(..., policy=...)`` carries (None without)."""
    return spec.params.get("agoq_storage")


def policy_of(spec) -> PolicySpec | None:
    """The activation policy a spec was built with (None: agoq disabled, Megatron's own storage)."""
    storage = storage_of(spec)
    return None if storage is None else storage.policy
