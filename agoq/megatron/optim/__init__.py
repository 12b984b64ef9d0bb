"""agoq's optimizers behind Megatron's optimizer API: the wrapper, the distributed shards, gradient release."""
