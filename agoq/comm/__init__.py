"""agoq.comm."""
