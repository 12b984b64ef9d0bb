"""agoq.policy."""
