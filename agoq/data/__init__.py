"""agoq.data."""
