"""agoq.train.tensorboard: Megatron tag names, the policy table as text, a clear error without the package."""

from __future__ import annotations

import sys

import pytest

from agoq.train import tensorboard as tb

RECORD = {"iteration": 7, "lm_loss": 6.5, "grad_norm": 1.25, "lr": 3e-4, "consumed_samples": 56,
          "skipped_iterations": 0, "step_seconds": 0.5, "tokens_per_second": 2048.0, "tflops_per_gpu": 12.5,
          "peak_gib": 3.0, "my_new_metric": 4}


class RecordingWriter:
    """Stands in for SummaryWriter: remembers calls."""

    def __init__(self, log_dir, max_queue):
        self.log_dir, self.max_queue = log_dir, max_queue
        self.scalars, self.texts, self.closed = [], [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def _logger(tmp_path):
    return tb.TensorBoardLogger(str(tmp_path), writer_class=RecordingWriter)


def test_iteration_scalars_use_megatron_tags_and_sample_axes(tmp_path):
    logger = _logger(tmp_path)
    logger.log_iteration(RECORD)
    scalars = {(tag, step): value for tag, value, step in logger._writer.scalars}
    assert scalars[("lm loss", 7)] == 6.5
    assert scalars[("lm loss vs samples", 56)] == 6.5
    assert scalars[("learning-rate", 7)] == 3e-4
    assert scalars[("grad-norm", 7)] == 1.25
    assert scalars[("throughput", 7)] == 12.5
    assert scalars[("iteration-time", 7)] == 0.5
    assert scalars[("mem-max-allocated-gib", 7)] == 3.0
    assert scalars[("my_new_metric", 7)] == 4  # unknown keys are kept under their own name, not dropped
    assert not any(tag in ("iteration", "consumed_samples") for tag, _ in scalars)


def test_none_values_are_skipped_and_non_numbers_rejected(tmp_path):
    logger = _logger(tmp_path)
    logger.log_iteration({"iteration": 1, "lm_loss": None, "lr": 1e-3})
    assert [tag for tag, _, _ in logger._writer.scalars] == ["learning-rate"]
    with pytest.raises(ValueError, match="lr='fast' is not a number"):
        logger.log_iteration({"iteration": 1, "lr": "fast"})
    with pytest.raises(ValueError, match="'iteration'"):
        logger.log_iteration({"lr": 1.0})


def test_thread_rows_become_one_scalar_per_thread_and_value(tmp_path):
    """--log-json host_threads (a list of rows) goes to TensorBoard as host_threads/<name>/cpu_seconds and
    .../wait_seconds, the training loop's thread as ``main``; a null list writes nothing."""
    logger = _logger(tmp_path)
    rows = [{"name": "python", "main": True, "cpu_seconds": 0.5, "wait_seconds": 0.01},
            {"name": "pt_autograd_0", "main": False, "cpu_seconds": 0.2, "wait_seconds": 0.0},
            {"name": "python", "main": False, "cpu_seconds": 0.25, "wait_seconds": 0.5},  # two unnamed Python threads
            {"name": "python", "main": False, "cpu_seconds": 0.5, "wait_seconds": 0.25}]
    logger.log_iteration({"iteration": 3, "host_threads": rows})
    logger.log_iteration({"iteration": 4, "host_threads": None})
    assert sorted(logger._writer.scalars) == [  # one value per tag and step: same-named rows summed
        ("host_threads/main/cpu_seconds", 0.5, 3), ("host_threads/main/wait_seconds", 0.01, 3),
        ("host_threads/pt_autograd_0/cpu_seconds", 0.2, 3), ("host_threads/pt_autograd_0/wait_seconds", 0.0, 3),
        ("host_threads/python/cpu_seconds", 0.75, 3), ("host_threads/python/wait_seconds", 0.75, 3)]


def test_policy_table_is_written_as_preformatted_text(tmp_path):
    logger = _logger(tmp_path)
    table = "layer role  format\n0     norm  nf4_b64"
    logger.log_policy_table(table)
    [(tag, text, step)] = logger._writer.texts
    assert (tag, step) == ("agoq/policy", 0)
    assert text.splitlines() == ["    layer role  format", "    0     norm  nf4_b64"]
    logger.close()
    assert logger._writer.closed


def test_open_tensorboard_only_writes_on_the_writer_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "_summary_writer_class", lambda: RecordingWriter)
    assert isinstance(tb.open_tensorboard(None, is_writer_rank=True), tb.NullTensorBoard)
    assert isinstance(tb.open_tensorboard(str(tmp_path), is_writer_rank=False), tb.NullTensorBoard)
    logger = tb.open_tensorboard(str(tmp_path), is_writer_rank=True)
    assert isinstance(logger, tb.TensorBoardLogger) and logger.log_dir == str(tmp_path)


def test_missing_tensorboard_package_is_a_clear_error_on_every_rank(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import raise ImportError, as when the package is absent.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    for rank_writes in (True, False):
        with pytest.raises(ValueError, match="pip install tensorboard"):
            tb.open_tensorboard(str(tmp_path), is_writer_rank=rank_writes)
    assert isinstance(tb.open_tensorboard(None, is_writer_rank=True), tb.NullTensorBoard)


def test_real_event_file_round_trip(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = tb.TensorBoardLogger(str(tmp_path))
    logger.log_iteration({"iteration": 3, "lm_loss": 5.0, "consumed_samples": 24})
    logger.log_policy_table("layer 0: nf4_b64")
    logger.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    [loss] = events.Scalars("lm loss")
    assert (loss.step, loss.value) == (3, 5.0)
    assert "agoq/policy/text_summary" in events.Tags()["tensors"]
