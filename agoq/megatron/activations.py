"""What agoq's layers store for backward, and how the saved bytes are accounted.

The policy is resolved per layer before Megatron builds the model (``agoq.megatron.layer_plan.ModelPlan``, carried by
``agoq_layer_spec(..., policy=, schedule=, save_paths=)`` as ``params["agoq_plan"]``): each layer's spec carries
what each of its modules stores (the storage rule of ``agoq.plan.storage``), and the layer passes each module its
format, counter key, counter, host paths and recompute role as constructor arguments (``ModuleSpec.params``), and
the recompute hand-offs (norm -> QKV / fc1, SwiGLU -> fc2) as ``Handoff`` objects owned by the layer and the MLP.

Accounting, two views:
- ``ModelPlan.counter`` (``SavedBytesCounter``): exact bytes agoq packs, per (layer, role);
  equal to ``agoq.plan.storage.agoq_bytes`` (the planner's formula).
- ``SavedTensorMeter``: every tensor saved for backward inside the metered region that agoq did not
  replace (Megatron's saves: attention internals, bf16 roles), de-duplicated by storage, parameters
  excluded. "Bytes held for backward" = meter bytes + counter bytes.

Seam card
---------
Touches: ``TransformerLayer`` submodule attribute names (``input_layernorm``, ``pre_mlp_layernorm``,
  ``self_attention.linear_qkv/linear_proj``, ``mlp.linear_fc1/linear_fc2``: read by ``agoq_modules``).
Why: the policy is per (layer, role); the built layers are where the bytes are saved.
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_activations.py``, ``tests/megatron/test_activations_pp.py``.
"""

from __future__ import annotations

import contextlib

import torch

from agoq.megatron.layer_plan import ModelPlan, plan_of
from agoq.megatron.layers import AgoqRMSNorm, _AgoqLinearMixin
from agoq.megatron.mlp import AgoqMLP
from agoq.policy import LAYER_ROLES, PolicySpec

__all__ = ["SavedTensorMeter", "agoq_modules", "policy_of", "storage_of", "storage_table"]


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


def storage_table(storage: ModelPlan) -> str:
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


def storage_of(spec) -> ModelPlan | None:
    """The model's plan (byte counter ``counter``, this rank's resolved ``layers``, ``policy``) a spec from
    ``agoq_layer_spec(..., policy=...)`` carries (None without a policy)."""
    plan = plan_of(spec)
    return None if plan is None or plan.policy is None else plan


def policy_of(spec) -> PolicySpec | None:
    """The activation policy a spec was built with (None: agoq disabled, Megatron's own storage)."""
    storage = storage_of(spec)
    return None if storage is None else storage.policy
