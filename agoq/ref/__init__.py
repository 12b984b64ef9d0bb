"""agoq.ref."""
