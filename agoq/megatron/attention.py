"""SDPA core attention for agoq's layer spec.

Seam card
---------
Touches: ``SelfAttentionSubmodules.core_attention`` in the local GPT layer spec (spec substitution,
  the first-choice seam); the constructor and ``forward`` signatures of
  ``megatron.core.transformer.dot_product_attention.DotProductAttention`` (mirrored here).
Why: the local spec's ``DotProductAttention`` is unfused: it materialises and saves the
  ``[b, h, s, s]`` softmax probabilities for backward (50.6 GiB peak for a 350M model at seq 2048,
  micro-batch 4 on an H200, measured by the team). ``torch.nn.functional.scaled_dot_product_attention``
  picks the flash / cuDNN / memory-efficient kernels on GPU and saves only q, k, v, out and the
  log-sum-exp. Both agoq and its BF16 baseline use it, so comparisons are like with like.
Verified on: megatron-core 0.19.2.
When disabled: ``--attention-backend megatron`` (scripts/pretrain_llama.py) / ``--agoq-attention megatron``
  (Megatron-LM's trainer) keeps Megatron's own ``DotProductAttention``.
Masks: Megatron-LM's data loader makes a causal attention mask by default (``--create-attention-mask-in-dataloader``);
  it is accepted (compared with the causal mask at each layer's first forward; SDPA runs ``is_causal=True``).
Guarded by: ``tests/megatron/test_attention.py`` (same output and gradients as DotProductAttention).

Shape legend: s = sequence, b = micro-batch, n = heads per TP rank, g = query groups per TP rank,
d = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Causal self-attention through ``scaled_dot_product_attention`` with native GQA.

    Takes and returns Megatron's layouts: q ``[s, b, n, d]``, k/v ``[s, b, g, d]`` → ``[s, b, n·d]``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        _check_supported(config, attn_mask_type)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.num_heads_per_rank = divide(config.num_attention_heads, tp_size)
        self.num_groups_per_rank = divide(config.num_query_groups, tp_size)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout_p:
            raise NotImplementedError(
                f"agoq SDPA attention runs without attention dropout (LLaMA uses 0), got {dropout_p}; "
                "set --attention-dropout 0, or use Megatron's DotProductAttention (--agoq-attention megatron through "
                "Megatron-LM's trainer, --attention-backend megatron in scripts/pretrain_llama.py)."
            )
        self.agoq_mask_checked = False  # the first attention mask was checked to be the causal mask

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError(
                "agoq SDPA attention is causal self-attention without an attention bias or packed sequences; use "
                "Megatron's DotProductAttention for those (--agoq-attention megatron through Megatron-LM's trainer, "
                "--attention-backend megatron in scripts/pretrain_llama.py)."
            )
        if attention_mask is not None:
            self._check_causal_mask(attention_mask, query.shape[0], key.shape[0])
        q_BNSD = query.permute(1, 2, 0, 3)
        k_BGSD = key.permute(1, 2, 0, 3)
        # value arrives as a strided view of the fused [s, b, g, (n/g + 2) d] QKV output (q and k are
        # rebuilt by RoPE); saved for backward as a view it keeps that whole buffer alive per layer and
        # micro-batch. A compact copy (g d per token) frees the other (n + g) d: saved bytes per token
        # and layer drop from 2 (n + 2g) d to 2 g d for v. contiguous() is a no-op for compact input.
        v_BGSD = value.contiguous().permute(1, 2, 0, 3)
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD,
            k_BGSD,
            v_BGSD,
            dropout_p=0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads_per_rank != self.num_groups_per_rank,
        )
        seq, batch = query.shape[0], query.shape[1]
        return out_BNSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)


    def _check_causal_mask(self, mask: torch.Tensor, seq_q: int, seq_k: int) -> None:
        """Accept the attention mask Megatron's data loader makes (``--create-attention-mask-in-dataloader``, on by
        default in Megatron-LM): boolean, True where a position is masked, ``[b or 1, 1, s, s]``, the causal mask
        without ``--reset-attention-mask``. SDPA runs ``is_causal=True``, which is that mask; the mask's values are
        compared with the causal mask once per layer (the first forward: one host sync), its shape every call."""
        shape_ok = mask.dim() == 4 and mask.shape[1] == 1 and tuple(mask.shape[-2:]) == (seq_q, seq_k)
        if mask.dtype != torch.bool or not shape_ok:
            raise NotImplementedError(
                f"agoq SDPA attention takes Megatron's causal mask from the data loader only (bool, [b, 1, {seq_q}, "
                f"{seq_k}]); got {mask.dtype} {tuple(mask.shape)}. Use Megatron's DotProductAttention for other masks "
                "(--agoq-attention megatron through Megatron-LM's trainer), or drop the mask "
                "(--no-create-attention-mask-in-dataloader)."
            )
        if self.agoq_mask_checked:
            return
        causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).triu(1)
        if not bool((mask == causal).all()):
            raise NotImplementedError(
                "agoq SDPA attention is causal over the whole sequence, but the data loader's attention mask is not "
                "the causal mask (--reset-attention-mask, or a custom mask); drop --reset-attention-mask, or use "
                "Megatron's DotProductAttention (--agoq-attention megatron through Megatron-LM's trainer)."
            )
        self.agoq_mask_checked = True


def _check_supported(config: TransformerConfig, attn_mask_type: AttnMaskType) -> None:
    problems = []
    if attn_mask_type != AttnMaskType.causal:
        problems.append(f"attn_mask_type={attn_mask_type.name} (only causal)")
    if config.context_parallel_size != 1:
        problems.append(f"context_parallel_size={config.context_parallel_size} (only 1)")
    if config.apply_query_key_layer_scaling:
        problems.append("apply_query_key_layer_scaling=True")
    if config.softmax_type != "vanilla":
        problems.append(f"softmax_type={config.softmax_type!r} (only 'vanilla')")
    if config.window_size is not None:
        problems.append(f"window_size={config.window_size} (no sliding window)")
    if problems:
        raise NotImplementedError(
            "agoq SDPA attention does not support: " + "; ".join(problems)
            + ". Use Megatron's DotProductAttention for these settings (--attention-backend megatron in "
            "scripts/pretrain_llama.py, --agoq-attention megatron through Megatron-LM's trainer)."
        )
