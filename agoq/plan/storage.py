"""What each transformer-layer role actually stores under a policy, and its exact byte count.

Pure Python (no torch, no Megatron): the Megatron layers (agoq.megatron.activations) and the memory
planner (agoq.plan) apply the *same* rule, so the planner's agoq bytes equal the bytes counted at
run time (tests/megatron/test_activations.py checks equality).

The rule (docs/numerics.md), per layer:
- ``norm.input`` quantized -> both pre-norms store their quantized input and recompute the norm in
  backward; the QKV / fc1 linears store nothing (their input is rebuilt from the same tensor), so
  ``attn.qkv_input`` / ``mlp.fc1_input`` are "recomputed". ``norm.input`` bf16 -> Megatron's norm
  saves as usual and ``attn.qkv_input`` / ``mlp.fc1_input`` follow their own format.
- ``mlp.swiglu_input`` quantized -> SwiGLU stores its quantized input (fc1 output) and is recomputed;
  fc2 stores nothing (``mlp.fc2_input`` "recomputed"). bf16 -> Megatron's SwiGLU; fc2 follows
  ``mlp.fc2_input``.
- ``attn.proj_input``: quantized or Megatron's save.
- ``attn.q/k/v/out``: always what the attention kernel saves (quantizing attention internals is not
  supported yet); a policy asking for a quantized format there is reported as "not applied".
- bf16 anywhere means "exactly what Megatron saves" (numerics-neutral).

Sequence parallelism (``LayerDims.sequence_parallel``, Megatron's ``--sequence-parallel``): the residual stream is
split along the sequence over the t tensor-parallel ranks, so what is saved of it (``norm.input``, and a QKV / fc1
input when the norm is not recomputed: ``attn.qkv_input`` / ``mlp.fc1_input``, the norms' fp32 rstd, the LM head's
final-norm and output-layer inputs) holds T / t tokens per rank (``SEQUENCE_SHARDED_ROLES``); the attention and MLP
internals between the column-parallel gather and the row-parallel reduce-scatter hold the whole sequence, as without.

Shape legend: T = tokens per micro-batch (seq x micro-batch), h = hidden, f = FFN hidden,
n / g = attention heads / query groups, d = head dim, t = tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agoq.formats import QuantFormat
from agoq.policy import LAYER_ROLES, PolicySpec, ScheduleInfo, Site, model_sites, resolve, resolve_name

MEGATRON = "megatron"  # saved by Megatron as usual (bf16 / training dtype)
QUANTIZED = "quantized"  # agoq stores a quantized copy
RECOMPUTED = "recomputed"  # nothing stored: rebuilt from another role's quantized tensor
NOT_APPLIED = "not applied"  # the policy asks for a format agoq cannot apply here yet

ATTENTION_INTERNALS = ("attn.q", "attn.k", "attn.v", "attn.out")
# the roles saved from the residual stream: split along the sequence over TP under sequence parallelism
SEQUENCE_SHARDED_ROLES = ("norm.input", "attn.qkv_input", "mlp.fc1_input")
BF16_BYTES = 2
FP32_BYTES = 4


@dataclass(frozen=True)
class RoleStorage:
    role: str
    requested: str  # format name the policy resolved to
    how: str  # MEGATRON | QUANTIZED | RECOMPUTED | NOT_APPLIED
    fmt: QuantFormat | None  # the stored format when how == QUANTIZED

    def describe(self) -> str:
        if self.how == QUANTIZED:
            return self.fmt.name
        if self.how == RECOMPUTED:
            return "recomputed"
        if self.how == NOT_APPLIED:
            return f"bf16 (asked {self.requested}: not supported)"
        return "bf16"


@dataclass(frozen=True)
class LayerStorage:
    layer_idx: int
    roles: dict[str, RoleStorage]

    @property
    def norm_recompute(self) -> bool:
        return self.roles["norm.input"].how == QUANTIZED

    @property
    def swiglu_recompute(self) -> bool:
        return self.roles["mlp.swiglu_input"].how == QUANTIZED

    def fmt(self, role: str) -> QuantFormat | None:
        """The quantized format agoq stores for ``role``, or None (Megatron's save or recomputed)."""
        return self.roles[role].fmt


def layer_storage(policy: PolicySpec, site_of: Callable[[str], Site], schedule: ScheduleInfo | None) -> LayerStorage:
    """Apply the rule above to one layer; ``site_of(role)`` gives the layer's Site for a role."""
    requested = {role: resolve(policy, site_of(role), schedule) for role in LAYER_ROLES}
    roles: dict[str, RoleStorage] = {}

    def put(role: str, how: str) -> None:
        fmt = requested[role]
        roles[role] = RoleStorage(role, fmt.name, how, fmt if how == QUANTIZED else None)

    def own(role: str) -> str:
        return QUANTIZED if requested[role].quantized else MEGATRON

    put("norm.input", own("norm.input"))
    for role in ("attn.qkv_input", "mlp.fc1_input"):
        put(role, RECOMPUTED if roles["norm.input"].how == QUANTIZED else own(role))
    put("attn.proj_input", own("attn.proj_input"))
    put("mlp.swiglu_input", own("mlp.swiglu_input"))
    put("mlp.fc2_input", RECOMPUTED if roles["mlp.swiglu_input"].how == QUANTIZED else own("mlp.fc2_input"))
    for role in ATTENTION_INTERNALS:
        put(role, NOT_APPLIED if requested[role].quantized else MEGATRON)
    return LayerStorage(site_of("norm.input").layer_idx, roles)


# Why a layer role stores nothing of its own, for a rule that names it (check_requests_take_effect)
_WHY_RECOMPUTED = {
    "attn.qkv_input": ("norm.input", "the input pre-norm is recomputed in backward and QKV rebuilds its input from the "
                       "norm's stored input"),
    "mlp.fc1_input": ("norm.input", "the pre-MLP norm is recomputed in backward and fc1 rebuilds its input from the "
                      "norm's stored input"),
    "mlp.fc2_input": ("mlp.swiglu_input", "SwiGLU is recomputed in backward and fc2 rebuilds its input from SwiGLU's "
                      "stored input"),
}


@dataclass(frozen=True)
class IneffectiveRequest:
    """A rule that names ``role`` and decides it somewhere, but where it decides, the role stores nothing of
    what it asks (``how``: RECOMPUTED or NOT_APPLIED at every such site)."""

    rule: int
    role: str
    requested: str
    how: str

    def message(self, source: str) -> str:
        head = (f"{source}: rules[{self.rule}] sets activations: {self.requested} for {self.role}, which never "
                "takes effect in this model and layout: ")
        if self.how == NOT_APPLIED:
            internals = ", ".join(ATTENTION_INTERNALS)
            return head + (f"agoq does not quantize the attention kernel's saved tensors ({internals}); they are "
                           "kept as the kernel saves them. Set them to bf16 or delete "
                           f"{self.role} from rules[{self.rule}].when.role")
        cause, why = _WHY_RECOMPUTED[self.role]
        return head + (f"wherever it decides, {cause} is quantized, so {why} (nothing of {self.role} is stored, "
                       f"whatever its format). Delete {self.role} from rules[{self.rule}].when.role, or keep "
                       f"{cause} in bf16 for those layers (a rule for {cause} before it) if {self.role} should "
                       "be saved as asked")


def ineffective_requests(policy: PolicySpec, sites: list[Site],
                         schedule: ScheduleInfo | None) -> list[IneffectiveRequest]:
    """The (rule, role) pairs of rules that name a layer role in ``when.role`` and decide it at some site of
    ``sites`` (pass every site of the model: ``agoq.policy.model_sites``), but at none of those sites does the role
    store what the rule asks: it is recomputed from another role's stored tensor, or a quantized format is asked of an
    attention internal. A rule without ``role`` (layers, stages) is left alone: it sets every role by design."""
    by_layer: dict[int, dict[str, Site]] = {}
    for site in sites:
        if site.layer_idx is not None and site.role in LAYER_ROLES:
            by_layer.setdefault(site.layer_idx, {})[site.role] = site
    outcomes: dict[tuple[int, str], tuple[str, set[str]]] = {}
    rules = {rule.index: rule for rule in policy.rules}
    for roles in by_layer.values():
        storage = layer_storage(policy, roles.__getitem__, schedule)
        for role, site in roles.items():
            source = resolve_name(policy, site, schedule)[1]
            if not source.startswith("rules["):
                continue
            index = int(source[len("rules["):source.index("]")])
            named = rules[index].when.roles
            if named is None or role not in named:
                continue
            entry = outcomes.setdefault((index, role), (rules[index].activations, set()))
            entry[1].add(storage.roles[role].how)
    return [IneffectiveRequest(index, role, requested, next(iter(hows)) if len(hows) == 1 else RECOMPUTED)
            for (index, role), (requested, hows) in sorted(outcomes.items())
            if hows <= {RECOMPUTED, NOT_APPLIED}]


def check_requests_on_model(policy: PolicySpec, num_layers: int, schedule: ScheduleInfo) -> None:
    """:func:`check_requests_take_effect` on every site of a uniformly split model (``agoq.policy.model_sites``);
    an uneven split is left to the layout checks, which refuse it first. The trainer's preflight, the trainer,
    Megatron-LM's model provider and ``python -m agoq.plan`` call this one."""
    if num_layers % (schedule.pp_size * (schedule.vp_size or 1)):
        return
    check_requests_take_effect(policy, model_sites(num_layers, schedule), schedule)


def check_requests_take_effect(policy: PolicySpec, sites: list[Site], schedule: ScheduleInfo | None) -> None:
    """Raise ValueError naming the policy file, the rule, the role and the fix when a rule's explicit request for a
    role never takes effect (:func:`ineffective_requests`): a policy does nothing silently."""
    bad = ineffective_requests(policy, sites, schedule)
    if bad:
        raise ValueError("\n".join(b.message(policy.source) for b in bad))


def sequence_parallel_note(tp: int) -> str:
    """What the planner's numbers assume under sequence parallelism (printed by ``python -m agoq.plan`` and the
    trainer's memory report)."""
    return (f"sequence parallelism over TP={tp}: the residual stream's saves ({', '.join(SEQUENCE_SHARDED_ROLES)}, the "
            f"norms' rstd, the LM head's final-norm and output-layer inputs) are sequence-sharded: 1/{tp} of their "
            "bytes per rank; attention and MLP internals hold the whole sequence; the backward's sequence all-gathers "
            "are modelled as without sequence parallelism (agoq.plan.storage)")


@dataclass(frozen=True)
class LayerDims:
    """Per-rank sizes of one layer's activations for one micro-batch."""

    seq: int
    micro_batch: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    tp: int = 1
    sequence_parallel: bool = False  # Megatron's sequence parallelism (module docstring)

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    @property
    def residual_tokens(self) -> int:
        """Tokens of the residual stream on one rank: T, or T / t under sequence parallelism."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def numel(self, role: str) -> int:
        """Elements of the tensor behind ``role`` on one tensor-parallel rank (the residual stream's roles
        sequence-sharded under sequence parallelism)."""
        t, h, tp, r = self.tokens, self.hidden, self.tp, self.residual_tokens
        d, n, g = self.head_dim, self.heads // tp, self.groups // tp
        return {
            "norm.input": r * h, "attn.qkv_input": r * h, "mlp.fc1_input": r * h,
            "attn.proj_input": t * n * d, "attn.q": t * n * d, "attn.k": t * g * d, "attn.v": t * g * d,
            "attn.out": t * n * d, "mlp.swiglu_input": t * 2 * self.ffn // tp, "mlp.fc2_input": t * self.ffn // tp,
        }[role]


def agoq_bytes(storage: LayerStorage, dims: LayerDims) -> dict[str, int]:
    """Exact bytes agoq stores per role for one micro-batch (what SavedBytesCounter counts)."""
    out = {}
    for role, rs in storage.roles.items():
        if rs.how != QUANTIZED:
            continue
        copies = 2 if role == "norm.input" else 1  # attention and MLP pre-norm
        out[role] = copies * rs.fmt.storage_bytes(dims.numel(role))
    return out


def megatron_bytes(storage: LayerStorage, dims: LayerDims, *, core_attn_recompute: bool = False,
                   rope_fused: bool = False) -> dict[str, int]:
    """Modelled bytes Megatron itself keeps per role (bf16 training dtype) for one micro-batch.

    Model (CUDA, megatron-core 0.19.2 local spec + agoq's SDPA attention):
    - a plain RMSNorm keeps its input (2 B/elt) and a fp32 rstd per token;
    - a plain linear keeps its input; plain SwiGLU (megatron.core.transformer.mlp ``glu``:
      ``silu(x_glu) * (x_linear + glu_linear_offset)``) keeps its input (2f: silu saves the x_glu
      view of the fc1 output), silu(x_glu) (f) and the new tensor ``x_linear + offset`` (f);
    - SDPA keeps q, k (after RoPE: own storage), out and the fp32 log-sum-exp per (token, head);
      agoq's SDPA keeps a compact copy of v ([T, g d]; the fused QKV output it was a view of is freed);
      RoPE keeps its cos and sin ([s, 1, 1, d], cast to bf16 per layer) for q and for k;
      ``rope_fused`` (agoq's fused RoPE, agoq.ops.rope): none per layer (one cached [s, d] cos / sin pair per run,
      ~1 MiB at seq 4096, shared by every layer, not modelled), and where each tensor-parallel rank holds whole
      query groups the QKV split runs in the same op, so v reaches attention compact
      (agoq.megatron.model.qkv_rope_fusable);
    - linear_proj's bf16 input is ``out.permute(2, 0, 1, 3).reshape(s, b, -1)``, a view of SDPA's
      output (allocated in the query's [s, b, n, d] memory order), so it adds no storage.
    ``core_attn_recompute`` (--recompute-granularity selective, Megatron's ``recompute_modules=["core_attn"]``):
    ``Attention._checkpointed_attention_forward`` runs the core attention under Megatron's CheckpointFunction,
    which saves its inputs instead of SDPA's saves. q and k are RoPE's outputs (as before); v is the strided
    view of the fused QKV output (agoq's compact copy is made inside the checkpointed core attention), so the
    whole [T, (n + 2g) d] buffer stays alive, except with the fused QKV split + RoPE, which hands attention a
    compact v ([T, g d]); SDPA's out and log-sum-exp are not saved, and linear_proj keeps
    its input, now a tensor of its own ([T, n d] bf16; nothing when agoq stores attn.proj_input quantized).
    With SDPA (flash) attention this saves *more* than no recompute (2 (n + g) d - 4 n bytes per token and
    layer): the recompute pays off only with Megatron's unfused attention, whose [b, n, s, s] probabilities
    it drops (not modelled here: the planner models SDPA).
    Checked against ``SavedTensorMeter`` (storages de-duplicated): on CPU per save (see
    tests/megatron/test_plan_peak.py), on the H100 as held bytes (docs/benchmarks/planner.md).
    """
    out = {}
    t = dims.tokens
    n, d = dims.heads // dims.tp, dims.head_dim
    for role, rs in storage.roles.items():
        if rs.how not in (MEGATRON, NOT_APPLIED):
            continue
        if core_attn_recompute and role in ("attn.v", "attn.out"):
            out[role] = _checkpointed_attention_bytes(role, storage, dims,
                                                      compact_v=rope_fused and dims.groups >= dims.tp)
            continue
        if role == "norm.input":
            out[role] = 2 * (BF16_BYTES * dims.numel(role) + FP32_BYTES * dims.residual_tokens)
        elif role == "mlp.swiglu_input":
            out[role] = BF16_BYTES * (dims.numel(role) + 2 * dims.numel("mlp.fc2_input"))
        elif role == "attn.proj_input":
            out[role] = 0  # a view of attn.out (counted there)
        elif role in ("attn.q", "attn.k"):
            out[role] = BF16_BYTES * (dims.numel(role) + (0 if rope_fused else 2 * dims.seq * d))
        elif role == "attn.out":
            out[role] = BF16_BYTES * dims.numel(role) + FP32_BYTES * t * n
        else:
            out[role] = BF16_BYTES * dims.numel(role)
    return out


def _checkpointed_attention_bytes(role: str, storage: LayerStorage, dims: LayerDims, compact_v: bool = False) -> int:
    """attn.v / attn.out under Megatron's core-attention recompute (``megatron_bytes``); ``compact_v``: the value
    comes out of the fused QKV split + RoPE as a tensor of its own."""
    n, g, d = dims.heads // dims.tp, dims.groups // dims.tp, dims.head_dim
    if role == "attn.v":  # the checkpoint's saved value: compact, or a view of the whole fused QKV output
        return BF16_BYTES * dims.tokens * (g if compact_v else n + 2 * g) * d
    proj_saved_by_megatron = storage.roles["attn.proj_input"].how in (MEGATRON, NOT_APPLIED)
    return BF16_BYTES * dims.numel("attn.out") if proj_saved_by_megatron else 0  # linear_proj's input


LOSS_BYTES_PER_TOKEN = 21  # final-norm fp32 rstd 4 + int64 masked target 8 + int64 target 8 + bool mask 1


def head_saved_bytes(dims: LayerDims, vocab: int) -> int:
    """Bytes the last stage's LM head and loss keep for backward, one micro-batch (bf16 head policy).

    Megatron's vocab_parallel_cross_entropy turns the fp32 copy of the logits (``logits.float()``) into
    exp(logits - max) in place and keeps it (4 B x T x V); the output layer keeps its input and the
    final RMSNorm its input (2 x bf16 [T, h]); targets, mask and rstd 21 B per token. Matches
    SavedTensorMeter's head bytes in docs/benchmarks/activations*.json (CUDA) to 8 bytes. Under sequence
    parallelism the two inputs and the final norm's rstd are sequence-sharded (T / t tokens; the output layer
    all-gathers its input, the logits cover the whole sequence)."""
    t, r = dims.tokens, dims.residual_tokens
    return (FP32_BYTES * t * (vocab // dims.tp) + 2 * BF16_BYTES * r * dims.hidden + FP32_BYTES * r
            + (LOSS_BYTES_PER_TOKEN - FP32_BYTES) * t)
