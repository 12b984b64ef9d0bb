"""agoq.optim."""
