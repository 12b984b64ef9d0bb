"""agoq.ops.rope on CPU (the reference inside one autograd node): forward and gradient equal the reference's, cos /
sin are computed once per live frequency tensor and again after an in-place change, and nothing is saved for
backward through saved-tensor hooks (the node keeps the shared constants as attributes)."""

import torch

from agoq.ops.rope import apply_qkv_rope, apply_rope, clear_trig_cache, rope_trig
from agoq.ref.rope import ref_rope_bwd, ref_rope_fwd


def _freqs(s=6, rot=8):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((ang, ang), dim=-1)[:, None, None, :]


def test_trig_cache_hits_per_tensor_and_follows_in_place_changes():
    clear_trig_cache()
    freqs = _freqs()
    cos, sin = rope_trig(freqs, torch.bfloat16)
    assert rope_trig(freqs, torch.bfloat16)[0] is cos  # cached
    assert rope_trig(freqs.clone(), torch.bfloat16)[0] is not cos  # another tensor: computed again
    assert torch.equal(cos, torch.cos(freqs[:, 0, 0]).to(torch.bfloat16))
    assert torch.equal(sin, torch.sin(freqs[:, 0, 0]).to(torch.bfloat16))
    freqs.mul_(2.0)  # an in-place change bumps the version: the cached pair is stale
    cos2, _ = rope_trig(freqs, torch.bfloat16)
    assert torch.equal(cos2, torch.cos(freqs[:, 0, 0]).to(torch.bfloat16)) and not torch.equal(cos2, cos)
    assert rope_trig(freqs, torch.float32)[0].dtype == torch.float32  # one entry per dtype


def test_apply_rope_equals_the_reference_and_saves_nothing_through_hooks():
    clear_trig_cache()
    freqs = _freqs()
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 8, generator=gen).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(6, 2, 3, 8, generator=gen).to(torch.bfloat16)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: packed.append(x) or x, lambda x: x):
        out = apply_rope(t, freqs)
    assert packed == []
    out.backward(grad)
    cos, sin = rope_trig(freqs, torch.bfloat16)
    assert torch.equal(out, ref_rope_fwd(t.detach(), cos, sin))
    assert torch.equal(t.grad, ref_rope_bwd(grad, cos, sin))


def test_inference_tensors_double_backward_and_other_dtypes():
    """Frequencies made under inference_mode (Megatron's generation) skip the cache; a second-order backward raises
    instead of dropping terms; float64 is refused with the fix."""
    import pytest

    clear_trig_cache()
    with torch.inference_mode():
        freqs = _freqs()
        out = apply_rope(torch.ones(6, 1, 2, 8), freqs)
    assert torch.equal(out, ref_rope_fwd(torch.ones(6, 1, 2, 8), *rope_trig(freqs, torch.float32)))
    t = torch.randn(6, 1, 2, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(apply_rope(t, _freqs()).square().sum(), t, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate"):
        grad.sum().backward()
    with pytest.raises(ValueError, match="--rope-fusion off"):
        apply_rope(torch.ones(6, 1, 2, 8, dtype=torch.float64), _freqs())


def test_apply_qkv_rope_equals_split_then_rope_in_one_node_saving_nothing():
    """The fused QKV node = Megatron's split path (split, query reshape, agoq's RoPE per tensor, value copied) in
    values and in the gradient of the fused QKV output, bit for bit; it saves nothing through hooks and refuses
    separate query / key frequencies."""
    import pytest

    clear_trig_cache()
    s, b, g, p, d = 6, 2, 3, 2, 8
    freqs, split = _freqs(s, d), [p * d, d, d]
    gen = torch.Generator().manual_seed(1)
    mixed = torch.randn(s, b, g, (p + 2) * d, generator=gen).to(torch.bfloat16)
    mixed.view(-1)[::7] = -0.0  # signed zeros: RoPE's gradient turns -0.0 to +0.0 for query / key, not for value
    grads = [torch.randn(s, b, h, d, generator=gen).to(torch.bfloat16) for h in (g * p, g, g)]
    for grad in grads:
        grad.view(-1)[::5] = -0.0
    fused_in = mixed.clone().requires_grad_(True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: packed.append(x) or x, lambda x: x):
        fused = apply_qkv_rope(fused_in, freqs, freqs, split)
    assert packed == [] and all(t.is_contiguous() for t in fused)
    torch.autograd.backward(fused, grads)
    split_in = mixed.clone().requires_grad_(True)
    query, key, value = torch.split(split_in, split, dim=3)
    unfused = (apply_rope(query.reshape(s, b, g * p, d), freqs), apply_rope(key, freqs), value.contiguous())
    torch.autograd.backward(unfused, grads)
    for a, c in zip(fused, unfused, strict=True):
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))
    assert torch.equal(fused_in.grad.view(torch.int16), split_in.grad.view(torch.int16))
    assert bool((fused_in.grad.view(torch.int16) == -32768).any())  # a -0.0 (value's) survives, as in the split path
    with pytest.raises(ValueError, match="one frequency tensor"):
        apply_qkv_rope(mixed, freqs, freqs.clone(), split)
