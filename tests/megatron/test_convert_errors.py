"""python -m agoq.convert agoq-to-hf: the checkpoint to read is named in the error when it is not there."""

from __future__ import annotations

import pytest

from agoq.megatron import checkpoint, hf_checkpoint


def test_an_iteration_that_was_not_saved_names_the_saved_ones(tmp_path):
    for it in (2, 10):
        (checkpoint.iteration_dir(tmp_path, it)).mkdir()
        (checkpoint.iteration_dir(tmp_path, it) / checkpoint.PROGRESS_FILE).write_text("{}")
    (tmp_path / checkpoint.TRACKER_FILE).write_text("10\n")
    # it used to say 'iter_0000007: not a complete agoq checkpoint (agoq_progress.json missing)'
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of iteration 7 \(iter_0000007 does not exist\); "
                                                r"saved iterations: 2, 10. Pass one of them, or leave --iteration out"):
        hf_checkpoint.checkpoint_source(tmp_path, 7)
    assert hf_checkpoint.checkpoint_source(tmp_path, 2) == checkpoint.iteration_dir(tmp_path, 2)
    assert hf_checkpoint.checkpoint_source(tmp_path) == checkpoint.iteration_dir(tmp_path, 10)
    checkpoint.iteration_dir(tmp_path, 3).mkdir()  # a save that did not finish keeps its own message
    with pytest.raises(FileNotFoundError, match="iter_0000003: not a complete agoq checkpoint"):
        hf_checkpoint.checkpoint_source(tmp_path, 3)
