"""Checkpoints: Megatron's dist checkpointing, resume checks, file safety, Hugging Face import/export."""
