"""The only agoq package that imports megatron (house rule 1)."""
