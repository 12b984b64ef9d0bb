"""Hugging Face LLaMA checkpoints in and out of agoq / Megatron distributed checkpoints.

``python -m agoq.convert hf-to-agoq`` and ``python -m agoq.convert agoq-to-hf`` (docs/user-guide.md). The tensor
mapping (:mod:`agoq.convert.llama`) is plain torch; reading and writing safetensors directories
(:mod:`agoq.convert.hf_io`) needs the optional extra ``[hf]``; the Megatron side (building the TP=1 / PP=1
model, saving and loading dist checkpoints) is :mod:`agoq.megatron.ckpt.hf_checkpoint`. Importing this package
imports none of megatron, transformers, safetensors or tokenizers.
"""
