"""agoq's layer spec on real megatron-core (CPU, one gloo rank): bf16 policy bit-identical to the
plain local spec, gradients under low-bit policies, exact saved-byte accounting vs the planner's
formula, Megatron's full activation recompute.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.megatron._tiny import TINY_SEQ, TINY_VOCAB, tiny_shape

pytestmark = pytest.mark.megatron

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"
SEQ, MICRO_BATCH, VOCAB = TINY_SEQ, 2, TINY_VOCAB
STEPS, LR = 2, 1e-2


def _build(policy, dtype=torch.float32, recompute=False, reference=None, save_paths=None, bias=False, glu_offset=0.0):
    """(model, storage) with agoq's spec; ``policy``: a configs/policy name, a YAML path, or None
    (the plain local spec, agoq disabled).
    Weights are copied from ``reference`` when given (so every variant starts from the same point)."""
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.activations import storage_of
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import ScheduleInfo

    shape = tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=dtype, use_cpu_initialization=True)
    config.add_bias_linear = bias  # LLaMA has none; tests of the linears' bias path turn it on
    config.glu_linear_offset = glu_offset  # LLaMA: 0; the SwiGLU paths' offset branch
    if recompute:  # Megatron's --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    if isinstance(policy, str):
        policy = POLICIES / f"{policy}.yaml"
    spec = agoq_layer_spec("sdpa", policy=policy,
                           schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1), save_paths=save_paths)
    (model,) = build_model_chunks(shape, config, spec, None)
    if dtype == torch.bfloat16:
        model = Float16Module(config, model)
    if reference is not None:
        model.load_state_dict(reference.state_dict())  # also proves the parameter names are unchanged
    return model, storage_of(spec)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(MICRO_BATCH, -1)


def _train(model, steps=STEPS):
    """Losses and per-parameter grads of ``steps`` SGD steps (same data for every model)."""
    losses, grads = [], []
    for step in range(steps):
        tokens, labels, pos = _batch(step)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return losses, grads


# SavePaths that run the hook / stash paths instead of agoq's one-node linears (same bytes and gradient bits)
_TWO_NODE = {"fuse_norm_linear": False, "fuse_swiglu_linear": False, "quantized_linear_node": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_policy_is_bit_identical_to_plain_spec(mcore_world1, dtype):
    plain, _ = _build(None, dtype)
    agoq, storage = _build("bf16", dtype, reference=plain)
    losses_plain, grads_plain = _train(plain)
    losses_agoq, grads_agoq = _train(agoq)
    assert storage.counter.total() == 0  # nothing went through agoq's storage
    for step in range(STEPS):
        assert torch.equal(losses_plain[step], losses_agoq[step])
        assert grads_plain[step].keys() == grads_agoq[step].keys()
        for name, grad in grads_plain[step].items():
            assert torch.equal(grad, grads_agoq[step][name]), f"step {step}: {name}"


# Per-parameter gradient SQNR floors vs the bf16 policy (fp32 model, one step). Each quantized
# saved tensor has round-trip SQNR >= gaussian_floor_db(fmt) (agoq.testing.numerics); a parameter's
# gradient sees the errors of the saved tensors on its backward path. With 2 layers x 3 stored
# roles, k <= 6 independent error sources of comparable power reach the first layer's weights, so
# SQNR >= G - 10 log10(6) ~ G - 7.8 dB; GRAD_FLOOR_SLACK_DB = 10 dB adds 2.2 dB for the non-Gaussian
# (heavy-tailed, post-norm) activations of a real model. A dropped scale, wrong micro-batch or
# wrong layer gives ~0 dB.
GRAD_FLOOR_SLACK_DB = 10.0


@pytest.mark.parametrize("policy,fmt_name", [("int8", "int8_b128"), ("agoq", "nf4_b64"), ("int4", "int4_b64")])
def test_low_bit_policy_gradients_vs_bf16(mcore_world1, policy, fmt_name, capsys):
    from agoq.formats import parse_format
    from agoq.testing.numerics import gaussian_floor_db, sqnr_db

    ref_model, _ = _build("bf16")
    model, storage = _build(policy, reference=ref_model)
    loss_ref, grads_ref = _train(ref_model, steps=1)
    loss, grads = _train(model, steps=1)
    assert torch.equal(loss[0], loss_ref[0])  # forward is unchanged: only backward sees quantized values
    floor = gaussian_floor_db(parse_format(fmt_name)) - GRAD_FLOOR_SLACK_DB
    report = {name: sqnr_db(g, grads[0][name]) for name, g in grads_ref[0].items()}
    with capsys.disabled():
        worst = min(report, key=report.get)
        print(f"\n[{policy}] per-parameter grad SQNR vs bf16: min {report[worst]:.1f} dB ({worst}), "
              f"median {sorted(report.values())[len(report) // 2]:.1f} dB, floor {floor:.1f} dB")
    for name, value in report.items():
        assert value >= floor, f"{policy}: {name} grad SQNR {value:.1f} dB < {floor:.1f} dB"
    # quantization really happened in the layers (an identical gradient would mean it did not)
    assert any(not math.isinf(v) for n, v in report.items() if "decoder.layers" in n)
    assert storage.counter.total() > 0


def _dims():
    from agoq.plan.storage import LayerDims

    return LayerDims(seq=SEQ, micro_batch=MICRO_BATCH, hidden=64, ffn=128, heads=4, groups=2)


@pytest.mark.parametrize("policy", ["agoq", "int8", "int4", "aggressive", "mixed"])
def test_saved_bytes_equal_planner_formula(mcore_world1, policy, tmp_path):
    """The counter (bytes packed at run time) equals agoq.plan.storage.agoq_bytes, per layer and role."""
    from agoq.plan.storage import agoq_bytes

    if policy == "mixed":  # norm kept by Megatron: the QKV / fc1 linears quantize their own input
        path = tmp_path / "mixed.yaml"
        path.write_text("version: 1\ndefault: {activations: int6_b64}\nrules:\n"
                        "  - when: {role: [norm.input, mlp.swiglu_input, attn.q, attn.k, attn.v, attn.out]}\n"
                        "    set: {activations: bf16}\n")
        model, storage = _build(path)
    else:
        model, storage = _build(policy)
    tokens, labels, pos = _batch(0)
    loss = model(tokens, pos, None, labels=labels).float().mean()
    for idx, layer in storage.layers.items():
        measured = {role: n for (i, role), n in storage.counter.packed.items() if i == idx}
        assert measured == agoq_bytes(layer, _dims()), f"layer {idx}"
    assert storage.counter.live == storage.counter.total() > 0
    loss.backward()
    assert storage.counter.live == 0  # every quantized copy is released by backward
    if policy == "mixed":
        roles = {role for _, role in storage.counter.packed}
        assert roles == {"attn.qkv_input", "mlp.fc1_input", "attn.proj_input", "mlp.fc2_input"}


def test_held_bytes_agoq_vs_bf16_and_planner(mcore_world1, capsys):
    """Bytes held for backward per layer (Megatron's saves metered + agoq's counter) in bf16:
    agoq.yaml vs the planner's prediction (within 5 %) and vs the bf16 policy."""
    from agoq.megatron.activations import SavedTensorMeter
    from agoq.plan.storage import agoq_bytes, megatron_bytes

    held = {}
    for policy in ("bf16", "agoq"):
        model, storage = _build(policy, torch.bfloat16)
        tokens, labels, pos = _batch(0)
        with SavedTensorMeter([model]) as meter:
            model(tokens, pos, None, labels=labels)
        held[policy] = {idx: meter.bytes_by_layer[idx] + sum(n for (i, _), n in storage.counter.packed.items()
                                                             if i == idx) for idx in storage.layers}
        if policy == "agoq":
            for idx, layer in storage.layers.items():
                predicted = sum(agoq_bytes(layer, _dims()).values()) + sum(megatron_bytes(layer, _dims()).values())
                assert abs(held["agoq"][idx] - predicted) <= 0.05 * predicted, (idx, held["agoq"][idx], predicted)
    ratio = sum(held["agoq"].values()) / sum(held["bf16"].values())
    with capsys.disabled():
        print(f"\n[held bytes per layer, bf16 model, CPU] bf16 policy {held['bf16']}, agoq {held['agoq']}, "
              f"ratio {ratio:.3f}")
    assert ratio < 0.5  # nf4 on the stored roles; attention internals stay bf16


def test_full_recompute_gives_the_same_gradients(mcore_world1, monkeypatch):
    """Megatron's full recompute: the first forward runs without a graph (agoq stores nothing), the
    recomputed forward stores the same quantized tensors, so gradients equal the non-recompute run."""
    if not torch.cuda.is_available():
        # CheckpointFunction saves/restores the CUDA RNG state; on CPU there is none (no dropout here,
        # so there is nothing to restore). Test-local shim; agoq.megatron.cpu_mode does not cover it.
        from megatron.core.tensor_parallel import random as mrandom

        monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.zeros(1, dtype=torch.uint8))
        monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
    ref, ref_storage = _build("agoq")
    model, storage = _build("agoq", recompute=True, reference=ref)
    grads = {}
    for m, st in ((ref, ref_storage), (model, storage)):
        tokens, labels, pos = _batch(0)
        loss = m(tokens, pos, None, labels=labels).float().mean()
        stored_in_forward = st.counter.total()
        loss.backward()
        grads[m] = (loss.detach(), stored_in_forward, st.counter.total(),
                    {n: p.grad.detach().clone() for n, p in m.named_parameters()})
    (loss_ref, fwd_ref, total_ref, grads_ref), (loss, fwd, total, grads_rc) = grads[ref], grads[model]
    assert fwd == 0 and fwd_ref == total_ref == total > 0  # recompute active: agoq stored only in backward
    assert torch.equal(loss, loss_ref)
    for name, grad in grads_ref.items():
        assert torch.equal(grad, grads_rc[name]), name
    assert storage.counter.live == 0


def test_inside_an_outer_saved_tensors_scope_the_same_storage_and_gradients(mcore_world1):
    """agoq's linears replace their saved input through the saved tensor's own hooks, or, when another
    saved_tensors_hooks scope is active (activation offloading, torch.utils.checkpoint), through a hook
    scope of their own: both store the same bytes and give the same gradients."""
    ref, ref_storage = _build("agoq")
    model, storage = _build("agoq", reference=ref)
    tokens, labels, pos = _batch(0)
    outer_packs = []

    def pack(t):
        outer_packs.append(1)
        return t

    results = []
    for m, st, scoped in ((ref, ref_storage, False), (model, storage, True)):
        if scoped:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = m(tokens, pos, None, labels=labels).float().mean()
        else:
            loss = m(tokens, pos, None, labels=labels).float().mean()
        packed = dict(st.counter.packed)
        loss.backward()
        results.append((loss.detach(), packed, {n: p.grad.detach().clone() for n, p in m.named_parameters()}))
    assert outer_packs  # the outer scope was active for the rest of the model
    (loss_a, packed_a, grads_a), (loss_b, packed_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and packed_a == packed_b and packed_a
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name
    assert storage.counter.live == 0 and ref_storage.counter.live == 0


def test_save_paths_option_reaches_every_agoq_module(mcore_world1, monkeypatch):
    """agoq_layer_spec(save_paths=...) is how a caller (a benchmark's A/B) picks the host path of the
    saved-activation code (no module constant to flip): every agoq module of the model gets it, the
    linears then run Megatron's linear in agoq's hook scope instead of the one-node paths, and bytes and gradients
    stay those of the default paths."""
    from agoq.megatron import layers
    from agoq.megatron.activations import agoq_modules
    from agoq.ops.saved_act import SavePaths

    scopes = []
    real_scope = layers.quantized_saves

    def counting_scope(*args, **kwargs):
        scopes.append(1)
        return real_scope(*args, **kwargs)

    monkeypatch.setattr(layers, "quantized_saves", counting_scope)
    paths = SavePaths(**_TWO_NODE)  # the hook-scope / stash paths instead of the one-node linears
    ref, ref_storage = _build("agoq")
    model, storage = _build("agoq", reference=ref, save_paths=paths)
    for layer in model.decoder.layers:
        assert all(m.agoq_save.paths is paths for m in agoq_modules(layer).values())
    tokens, labels, pos = _batch(0)
    results = []
    for m, st in ((ref, ref_storage), (model, storage)):
        before = len(scopes)
        loss = m(tokens, pos, None, labels=labels).float().mean()
        results.append((len(scopes) - before, dict(st.counter.packed)))
        loss.backward()
        results[-1] += ({n: p.grad.detach().clone() for n, p in m.named_parameters()},)
    (scopes_ref, packed_ref, grads_ref), (scopes_new, packed_new, grads_new) = results
    assert scopes_new > scopes_ref  # the option switched the linears' path
    assert packed_ref == packed_new and packed_ref
    for name, grad in grads_ref.items():
        assert torch.equal(grad, grads_new[name]), name


def test_layer_settings_reach_modules_through_their_constructors(mcore_world1):
    """Each layer gets its resolved row through its own spec (resolved before the build) and hands every agoq module
    its format, counter key, counter, paths and recompute role as constructor arguments (ModuleSpec.params), and the
    recompute hand-offs as objects shared by producer and consumer; the template spec is not modified (the
    per-layer arguments live in per-layer copies)."""
    from agoq.megatron.activations import agoq_modules
    from agoq.megatron.layers import AgoqRMSNorm, Handoff
    from agoq.megatron.model import agoq_layer_spec
    from agoq.policy import ScheduleInfo

    model, storage = _build("agoq")
    roles = {"input_layernorm": "norm.input", "pre_mlp_layernorm": "norm.input", "linear_qkv": "attn.qkv_input",
             "linear_proj": "attn.proj_input", "mlp": "mlp.swiglu_input", "linear_fc1": "mlp.fc1_input",
             "linear_fc2": "mlp.fc2_input"}
    recomputed = {"linear_qkv", "linear_fc1", "linear_fc2"}  # agoq.yaml quantizes the norm and SwiGLU inputs
    for layer in model.decoder.layers:
        idx = layer.layer_number - 1
        mods = agoq_modules(layer)
        for name, role in roles.items():
            save = mods[name].agoq_save
            assert (save.fmt, save.key, save.recomputed) == (storage.layers[idx].fmt(role), (idx, role),
                                                             name in recomputed), (idx, name)
            assert save.counter is storage.counter
        attn_handoff, mlp_handoff = layer.agoq_handoffs
        assert isinstance(attn_handoff, Handoff) and attn_handoff is not mlp_handoff
        assert mods["input_layernorm"].agoq_handoff is attn_handoff is mods["linear_qkv"].agoq_handoff
        assert mods["pre_mlp_layernorm"].agoq_handoff is mlp_handoff is mods["linear_fc1"].agoq_handoff
        assert mods["linear_fc2"].agoq_handoff is mods["mlp"].agoq_fc2_handoff
        assert mods["linear_proj"].agoq_handoff is None
    handoffs = [h for layer in model.decoder.layers for h in layer.agoq_handoffs]
    assert len({id(h) for h in handoffs}) == len(handoffs)  # one hand-off per layer and pair
    spec = agoq_layer_spec("sdpa", policy=POLICIES / "agoq.yaml", schedule=ScheduleInfo(1, None, 1))
    assert spec.submodules.input_layernorm is AgoqRMSNorm  # the template spec carries only the model's plan
    assert set(spec.params) == {"agoq_plan"}
    for layer in model.decoder.layers:  # each layer was built with its own row of the one plan
        assert layer.agoq_options.position.layer_idx == layer.layer_number - 1
        assert layer.agoq_options.storage is storage.layers[layer.layer_number - 1]


def test_handoff_order_is_checked(mcore_world1):
    """The hand-offs raise instead of letting a linear recompute from the wrong tensor: a recomputing
    consumer run without its producer's stash, a producer run twice before its consumer, and a consumer
    fed another tensor than the producer's output."""
    model, _ = _build("agoq")
    layer = model.decoder.layers[0]
    x_SBH = torch.randn(SEQ, MICRO_BATCH, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\(0, 'attn.qkv_input'\) expects its input .*left no stash"):
        layer.self_attention.linear_qkv(x_SBH)
    with pytest.raises(RuntimeError, match="SwiGLU -> linear_fc2.*left no stash"):
        layer.mlp.linear_fc2(torch.randn(SEQ, MICRO_BATCH, 128, requires_grad=True))
    layer.input_layernorm(x_SBH)
    with pytest.raises(RuntimeError, match="input_layernorm -> linear_qkv: the producer ran again"):
        layer.input_layernorm(x_SBH)
    y_SBH = layer.pre_mlp_layernorm(x_SBH)
    with pytest.raises(RuntimeError, match="input is not the output of the recomputable op"):
        layer.mlp.linear_fc1(y_SBH.clone())
    for handoff in layer.agoq_handoffs:
        handoff.take()
    layer.mlp.linear_fc1(layer.pre_mlp_layernorm(x_SBH))  # in order: fine
    assert not any(h.pending for h in layer.agoq_handoffs)
    # SwiGLU -> fc2 as one node (agoq.ops.swiglu_linear): fc2 fed another tensor than SwiGLU's output, a feed used twice
    from agoq.ops.swiglu_linear import swiglu_linear, swiglu_no_graph

    mlp = layer.mlp
    h_SBF2 = torch.randn(SEQ, MICRO_BATCH, 256, requires_grad=True)
    feed = swiglu_no_graph(h_SBF2, mlp.agoq_save.fmt, mlp.agoq_save.key, None)
    mlp.agoq_fc2_handoff.put(feed)
    with pytest.raises(RuntimeError, match=r"not the output of the recomputable op before it \(the SwiGLU"):
        mlp.linear_fc2(feed.z.clone())
    swiglu_linear(feed, mlp.linear_fc2.weight)
    with pytest.raises(RuntimeError, match="used by a linear already"):
        swiglu_linear(feed, mlp.linear_fc2.weight)


def test_one_node_linears_refuse_a_second_backward_and_stay_out_of_other_hook_scopes(mcore_world1):
    """The one-node linears release their codes in backward: a second backward through the same graph raises and
    names the fix instead of failing on a None. Inside another saved-tensor hook scope (activation offloading, a
    meter) the layers take the hook / stash paths, whose scope is innermost: no agoq node in the graph, the same
    gradients."""
    from agoq.formats import parse_format
    from agoq.ops.norm_linear import NormFeed, rmsnorm_linear, rmsnorm_no_graph
    from agoq.ops.quant_linear import quantized_input_linear
    from agoq.ops.swiglu_linear import swiglu_linear, swiglu_no_graph

    fmt, key = parse_format("int8_b128"), (0, "test")
    x = torch.randn(8, 128, requires_grad=True)
    w, g = torch.randn(64, 128, requires_grad=True), torch.ones(128, requires_grad=True)
    nodes = {"quantized-input linear node": lambda: quantized_input_linear(x, w, None, fmt, key),
             "SwiGLU + linear node": lambda: swiglu_linear(swiglu_no_graph(x, fmt, key, None), w[:, :64]),
             "norm + linear node": lambda: rmsnorm_linear(NormFeed(x, g, 1e-5, rmsnorm_no_graph(x, g, 1e-5), fmt, key,
                                                                   None), w)}
    for node, run in nodes.items():
        out = run().sum()
        out.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=re.escape(node) + r": its backward already ran.*retain_graph=True"):
            out.backward()
    model, _ = _build("agoq")
    tokens, labels, pos = _batch(0)
    model(tokens, pos, None, labels=labels).float().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fc2 = _layers(model)[0].mlp.linear_fc2
    seen = []
    hook = fc2.register_forward_hook(lambda m, i, out: seen.append(_node_names(out[0])))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = model(tokens, pos, None, labels=labels).float().mean()
    hook.remove()
    assert seen and not any(name.startswith(("_SwiGLULinear", "_QuantizedInputLinear", "_RMSNormLinear"))
                            for name in seen[0]), seen
    loss.backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name]), name


def _node_names(out_tensor, depth: int = 3) -> set[str]:
    """Names of the autograd nodes within ``depth`` steps of ``out_tensor``'s grad_fn (Megatron's TP=1 identity
    functions may sit above agoq's node)."""
    names, frontier = set(), [out_tensor.grad_fn]
    for _ in range(depth):
        frontier = [fn for fn in frontier if fn is not None]
        names |= {fn.name() for fn in frontier}
        frontier = [nxt for fn in frontier for nxt, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_linear_and_swiglu_linear_nodes_equal_the_two_node_path(mcore_world1, dtype):
    """The default path runs each pre-norm and the linear it feeds (QKV, fc1) as one autograd node
    (agoq.ops.norm_linear) and SwiGLU with fc2 as one node (agoq.ops.swiglu_linear); ``SavePaths(fuse_norm_linear=
    False, fuse_swiglu_linear=False)`` runs the norm's / SwiGLU's autograd function handing a recompute stash to
    Megatron's linear. Same forward, same gradient bits, same bytes counted under the same keys, the same live bytes
    after backward; the one-node paths really ran (QKV's and fc2's outputs come from agoq's nodes) and only where
    they apply (not under the bf16 policy)."""
    from agoq.ops.saved_act import SavePaths

    two_node, st_two = _build("agoq", dtype, save_paths=SavePaths(**_TWO_NODE))
    one_node, st_one = _build("agoq", dtype, reference=two_node)
    for layer_two, layer_one in zip(_layers(two_node), _layers(one_node), strict=True):
        assert [h.accepts_feed for h in layer_one.agoq_handoffs] == [True, True]
        assert [h.accepts_feed for h in layer_two.agoq_handoffs] == [False, False]
        assert layer_one.mlp.agoq_fc2_handoff.accepts_feed and not layer_two.mlp.agoq_fc2_handoff.accepts_feed
    nodes = {"qkv": [], "fc2": []}
    first = _layers(one_node)[0]
    hooks = [mod.register_forward_hook(lambda m, i, out, key=key: nodes[key].append(_node_names(out[0])))
             for key, mod in (("qkv", first.self_attention.linear_qkv), ("fc2", first.mlp.linear_fc2))]
    losses_two, grads_two = _train(two_node)
    losses_one, grads_one = _train(one_node)
    for hook in hooks:
        hook.remove()
    assert nodes["qkv"] and all("_RMSNormLinearBackward" in names for names in nodes["qkv"]), nodes
    assert nodes["fc2"] and all("_SwiGLULinearBackward" in names for names in nodes["fc2"]), nodes
    for step in range(STEPS):
        assert torch.equal(losses_two[step], losses_one[step]), step
        for name, grad in grads_two[step].items():
            assert torch.equal(grad, grads_one[step][name]), f"step {step}: {name}"
    assert st_one.counter.packed == st_two.counter.packed and st_one.counter.total() > 0
    assert st_one.counter.tensors == st_two.counter.tensors
    assert st_one.counter.peak == st_two.counter.peak and st_one.counter.live == st_two.counter.live == 0
    plain, _ = _build("bf16", dtype)
    assert not any(h.accepts_feed for layer in _layers(plain) for h in (*layer.agoq_handoffs,
                                                                         layer.mlp.agoq_fc2_handoff))


LINEARS_INT8 = Path(__file__).resolve().parent / "policies" / "linears_int8.yaml"  # every linear stores its input


@pytest.mark.parametrize("bias", [False, True])
def test_quantized_input_linear_node_equals_the_hook_path(mcore_world1, bias):
    """A linear that stores its own input quantized runs as one autograd node (agoq.ops.quant_linear) by default;
    ``SavePaths(quantized_linear_node=False)`` runs Megatron's linear inside agoq's saved-tensor hook scope. With the
    norms and SwiGLU kept in bf16 every linear stores its input (QKV and fc1 column-parallel, out-projection and fc2
    row-parallel), so each kind takes the node: the same losses and gradient bits over the training steps (biases
    included), the same bytes per key, nothing left live; the node really ran on QKV and fc2."""
    from agoq.ops.saved_act import SavePaths

    policy = LINEARS_INT8
    hooks_model, st_hooks = _build(policy, save_paths=SavePaths(quantized_linear_node=False), bias=bias)
    node_model, st_node = _build(policy, reference=hooks_model, bias=bias)
    first = _layers(node_model)[0]
    assert all(mod.agoq_quantized_node for mod in (first.self_attention.linear_qkv, first.self_attention.linear_proj,
                                                   first.mlp.linear_fc1, first.mlp.linear_fc2))
    assert not _layers(hooks_model)[0].self_attention.linear_proj.agoq_quantized_node
    nodes = []
    hooks = [mod.register_forward_hook(lambda m, i, out: nodes.append(_node_names(out[0])))
             for mod in (first.self_attention.linear_qkv, first.mlp.linear_fc2)]
    losses_hooks, grads_hooks = _train(hooks_model)
    losses_node, grads_node = _train(node_model)
    for hook in hooks:
        hook.remove()
    assert nodes and all("_QuantizedInputLinearBackward" in names for names in nodes), nodes
    for step in range(STEPS):
        assert torch.equal(losses_hooks[step], losses_node[step]), step
        assert grads_hooks[step].keys() == grads_node[step].keys()
        for name, grad in grads_hooks[step].items():
            assert torch.equal(grad, grads_node[step][name]), f"step {step}: {name}"
    if bias:
        assert any(name.endswith("linear_qkv.bias") for name in grads_node[0])
    assert st_node.counter.packed == st_hooks.counter.packed and st_node.counter.total() > 0
    assert {key[1] for key in st_node.counter.packed} >= {"attn.qkv_input", "attn.proj_input", "mlp.fc1_input",
                                                          "mlp.fc2_input"}
    assert st_node.counter.tensors == st_hooks.counter.tensors
    assert st_node.counter.peak == st_hooks.counter.peak and st_node.counter.live == st_hooks.counter.live == 0


@pytest.mark.parametrize("variant", ["bias", "frozen_linears", "frozen_norms", "glu_offset"])
def test_norm_linear_node_bias_and_frozen_weights_equal_the_two_node_path(mcore_world1, variant, monkeypatch):
    """The one-node linears against the two-node paths where the tiny LLaMA has nothing to show: linears with a bias
    (its gradient), frozen QKV / fc1 / fc2 weights (Megatron's LinearWithFrozenWeight backward: dgrad through a 2-D
    view, no weight or bias gradient), frozen norm weights, and a GLU offset (SwiGLU's ``up + offset`` in forward,
    recompute and backward). One forward + backward, fp32: the same loss and gradients bit for bit, and the same
    parameters without a gradient."""
    from agoq.ops.saved_act import SavePaths

    bias, offset = variant == "bias", 0.5 if variant == "glu_offset" else 0.0
    two_node, _ = _build("agoq", save_paths=SavePaths(**_TWO_NODE), bias=bias, glu_offset=offset)
    one_node, _ = _build("agoq", reference=two_node, bias=bias, glu_offset=offset)
    assert _layers(one_node)[0].mlp.agoq_fc2_handoff.accepts_feed
    frozen = {"frozen_linears": ("linear_qkv.weight", "linear_fc1.weight", "linear_fc2.weight"),
              "frozen_norms": ("input_layernorm.weight", "pre_mlp_layernorm.weight")}.get(variant, ())
    results = []
    for model in (two_node, one_node):
        for name, param in model.named_parameters():
            param.requires_grad_(not name.endswith(frozen))
        tokens, labels, pos = _batch(0)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: None if p.grad is None else p.grad.clone()
                                        for n, p in model.named_parameters()}))
    (loss_two, grads_two), (loss_one, grads_one) = results
    assert torch.equal(loss_two, loss_one)
    assert {n for n, g in grads_two.items() if g is None} == {n for n, g in grads_one.items() if g is None}
    assert sum(g is None for g in grads_one.values()) == (2 * len(frozen) if frozen else 0)  # 2 layers
    if bias:
        assert any(n.endswith("linear_qkv.bias") for n in grads_one)
    for name, grad in grads_two.items():
        assert grad is None or torch.equal(grad, grads_one[name]), name


def _layers(model):
    """The decoder layers of a model built by _build (a bf16 model is wrapped in Float16Module)."""
    return getattr(model, "module", model).decoder.layers


def test_megatron_options_that_feed_recomputing_linears_otherwise_are_refused(mcore_world1, monkeypatch):
    """Megatron's norm recompute (recompute_modules "layernorm") runs agoq's norm without a graph, its MLP recompute
    ("mlp") runs fc1 without grad on the norm's output (the norm + linear node would not be recorded: the gradients
    of the pre-MLP norm, fc1 and fc2 were lost without an error) and its MLP chunking feeds fc1 / fc2 chunks: with a
    policy that recomputes the norms / SwiGLU, building the layer raises with the option and the fix; the bf16 policy
    (nothing recomputed) builds, and so does core-attention recompute."""
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import ScheduleInfo

    def build(policy, **overrides):
        shape = tiny_shape()
        config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.float32,
                                          use_cpu_initialization=True)
        for name, value in overrides.items():
            setattr(config, name, value)
        spec = agoq_layer_spec("sdpa", policy=POLICIES / f"{policy}.yaml",
                               schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1))
        return build_model_chunks(shape, config, spec, None)

    layernorm = dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"])
    with pytest.raises(NotImplementedError, match="'layernorm'.*drop 'layernorm' from --recompute-modules"):
        build("agoq", **layernorm)
    with pytest.raises(NotImplementedError, match="'mlp'.*drop 'mlp' from --recompute-modules"):
        build("agoq", recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    with pytest.raises(NotImplementedError, match="mlp_chunks_for_training=2: leave it at 1"):
        build("agoq", mlp_chunks_for_training=2)
    build("bf16", **layernorm)
    build("bf16", mlp_chunks_for_training=2)
    build("agoq", recompute_granularity="selective", recompute_modules=["core_attn"])
    # past the construction check (a spec built another way), the node itself refuses to run without grad on a norm
    # output made with grad, instead of losing the pre-MLP norm's, fc1's and fc2's gradients
    from agoq.megatron import transformer_layer

    monkeypatch.setattr(transformer_layer, "check_megatron_recompute", lambda config, storage: None)
    (model,) = build("agoq", recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    tokens, labels, pos = _batch(0)
    with pytest.raises(RuntimeError, match="runs without grad on a norm output made with grad"):
        model(tokens, pos, None, labels=labels)


def test_agoq_norm_names_megatron_lm_flags_for_what_it_cannot_run(mcore_world1):
    """Issue 42 item 2: the norm said "supports normalization='RMSNorm' ... (got normalization='RMSNorm')"; it names
    each setting and Megatron-LM's flag for it."""
    from agoq.megatron.layers import AgoqRMSNorm
    from agoq.megatron.model import ParallelLayout, llama_transformer_config

    config = llama_transformer_config(tiny_shape(), ParallelLayout(), params_dtype=torch.float32,
                                      use_cpu_initialization=True)
    config.persist_layer_norm = True
    with pytest.raises(NotImplementedError, match="persist_layer_norm=True \\(add --no-persist-layer-norm") as info:
        AgoqRMSNorm(config, 64)
    assert "got normalization" not in str(info.value)
    config.persist_layer_norm, config.normalization = False, "LayerNorm"
    with pytest.raises(NotImplementedError, match="add --normalization RMSNorm"):
        AgoqRMSNorm(config, 64)
