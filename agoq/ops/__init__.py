"""agoq.ops."""
