"""SDPACoreAttention is a drop-in for Megatron's DotProductAttention (causal, GQA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron


def _config(num_heads=4, num_groups=2, head_dim=16):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        num_query_groups=num_groups, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
    )


@pytest.mark.parametrize("num_heads,num_groups", [(4, 2), (4, 4), (6, 1)])
def test_sdpa_matches_dot_product_attention_fp32(mcore_world1, num_heads, num_groups):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from agoq.megatron.attention import SDPACoreAttention

    config = _config(num_heads, num_groups)
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, theirs = SDPACoreAttention(**kwargs), DotProductAttention(**kwargs)
    gen = torch.Generator().manual_seed(0)
    seq, batch, dim = 13, 3, 16  # odd sequence length
    q = torch.randn(seq, batch, num_heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(seq, batch, num_groups, dim, generator=gen, requires_grad=True)
    v = torch.randn(seq, batch, num_groups, dim, generator=gen, requires_grad=True)
    out_ours = ours(q, k, v, None)
    grads_ours = torch.autograd.grad(out_ours.square().sum(), (q, k, v))
    out_theirs = theirs(q, k, v, None)
    grads_theirs = torch.autograd.grad(out_theirs.square().sum(), (q, k, v))
    assert out_ours.shape == out_theirs.shape == (seq, batch, num_heads * dim)
    # fp32, same math, different summation order: a few ulps of values O(1) -> 1e-5 is ample and
    # far below any real difference (a wrong mask or GQA mapping changes outputs by O(0.1)).
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
    for g_ours, g_theirs in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-4)


def test_sdpa_refuses_unsupported_settings(mcore_world1):
    from megatron.core.transformer.enums import AttnMaskType

    from agoq.megatron.attention import SDPACoreAttention

    with pytest.raises(NotImplementedError, match="--attention-backend megatron"):
        SDPACoreAttention(config=_config(), layer_number=1, attn_mask_type=AttnMaskType.padding,
                          attention_type="self")


def test_sdpa_takes_the_data_loaders_causal_mask_and_refuses_others(mcore_world1):
    """Megatron-LM's loader makes a causal mask by default (--create-attention-mask-in-dataloader; True = masked,
    [b, 1, s, s]): accepted, the same output as without it; a mask that is not causal (--reset-attention-mask's
    document boundaries) or of another shape is refused naming Megatron-LM's flags, not agoq's trainer's."""
    from megatron.core.transformer.enums import AttnMaskType

    from agoq.megatron.attention import SDPACoreAttention

    ours = SDPACoreAttention(config=_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self")
    gen = torch.Generator().manual_seed(1)
    seq, batch = 9, 2
    q = torch.randn(seq, batch, 4, 16, generator=gen)
    k, v = torch.randn(seq, batch, 2, 16, generator=gen), torch.randn(seq, batch, 2, 16, generator=gen)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1).expand(batch, 1, seq, seq)
    assert torch.equal(ours(q, k, v, causal), ours(q, k, v, None))
    assert ours.agoq_mask_checked
    fresh = SDPACoreAttention(config=_config(), layer_number=2, attn_mask_type=AttnMaskType.causal,
                              attention_type="self")
    documents = causal.clone()
    documents[:, :, 5:, :5] = True  # a second document from position 5 on (--reset-attention-mask)
    with pytest.raises(NotImplementedError, match="--reset-attention-mask") as info:
        fresh(q, k, v, documents)
    assert "--agoq-attention megatron" in str(info.value)
    with pytest.raises(NotImplementedError, match="--no-create-attention-mask-in-dataloader"):
        fresh(q, k, v, causal.float())
