"""agoq's 8-bit gradients in Megatron's DDP: buffers, store, reader, transport."""
