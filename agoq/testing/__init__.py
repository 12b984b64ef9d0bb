"""agoq.testing."""
