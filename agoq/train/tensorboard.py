"""Optional TensorBoard output: per-iteration scalars under Megatron's tag names, and the policy table as text.

Uses ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package
(``pip install tensorboard``). Megatron prints a warning and writes nothing when the package is missing
(``megatron/training/global_vars.py``); agoq refuses to start instead, on every rank, so a run that was
asked to log never runs without its logs (house rule: nothing silent).

One rank writes: Megatron uses the last rank, which holds the loss. The caller decides with
``is_writer_rank``; the other ranks get a ``NullTensorBoard`` whose methods do nothing.

Usage (in the train loop)::

    tb = open_tensorboard(args.tensorboard_dir, is_writer_rank=training.is_logging_rank())
    tb.log_policy_table(policy_text)
    tb.log_iteration({"iteration": 10, "lm_loss": 7.1, "lr": 3e-4, "consumed_samples": 80, ...})
    tb.close()
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping

# Record key (as in --log-json lines) -> TensorBoard tag. Megatron's names where Megatron logs the
# same quantity (megatron/training/training.py, training_log, megatron-core 0.19.2); memory is in GiB
# here (Megatron logs bytes), so the tags say so.
SCALAR_TAGS = {
    "lm_loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "skipped_iterations": "skipped-iterations",
    "step_seconds": "iteration-time",
    "tflops_per_gpu": "throughput",  # Megatron's 'throughput' is TFLOP/s per GPU
    "tokens_per_second": "tokens-per-sec",
    "global_batch_size": "batch-size",
    "allocated_gib": "mem-allocated-gib",
    "peak_gib": "mem-max-allocated-gib",
    "reserved_gib": "mem-reserved-gib",
    "rss_gib": "mem-rss-gib",
}
# Megatron also plots these against consumed samples ('<tag> vs samples').
VS_SAMPLES = ("lm_loss", "lr", "grad_norm")
NOT_SCALARS = ("iteration", "consumed_samples")
THREADS_KEY = "host_threads"  # a list of per-thread rows (hoststats.threads_since): one scalar per thread and value
POLICY_TAG = "agoq/policy"
DEFAULT_MAX_QUEUE = 1000  # Megatron's --tensorboard-queue-size default


def _summary_writer_class() -> Callable:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch raises ImportError when the tensorboard package is absent
        raise ValueError(
            "--tensorboard-dir needs the 'tensorboard' package, which is not installed: "
            "pip install tensorboard (or drop --tensorboard-dir)"
        ) from exc
    return SummaryWriter


class NullTensorBoard:
    """Same methods as TensorBoardLogger; used when no log directory was asked for, or off the writer rank."""

    def log_iteration(self, record: Mapping[str, float | int | None]) -> None:
        pass

    def log_policy_table(self, text: str, iteration: int = 0) -> None:
        pass

    def log_text(self, tag: str, text: str, iteration: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """A SummaryWriter with agoq's record keys mapped to Megatron's tags."""

    def __init__(self, log_dir: str, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 writer_class: Callable | None = None):
        cls = writer_class or _summary_writer_class()
        self.log_dir = str(log_dir)
        self._writer = cls(log_dir=self.log_dir, max_queue=max_queue)

    def log_iteration(self, record: Mapping[str, float | int | None]) -> None:
        """Write every numeric value of one iteration's record; keys without a Megatron tag keep their name.

        ``record`` must hold ``iteration``; ``consumed_samples`` adds the 'vs samples' plots. ``None``
        values (e.g. the loss off the last pipeline stage) are not written.
        """
        if "iteration" not in record:
            raise ValueError(f"log_iteration: the record needs an 'iteration' key, got keys {sorted(record)}")
        step = int(record["iteration"])
        samples = record.get("consumed_samples")
        for key, value in _scalars(record):
            if key in NOT_SCALARS or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real
                raise ValueError(f"log_iteration: {key}={value!r} is not a number")
            tag = SCALAR_TAGS.get(key, key)
            self._writer.add_scalar(tag, value, step)
            if key in VS_SAMPLES and samples is not None:
                self._writer.add_scalar(f"{tag} vs samples", value, int(samples))

    def log_policy_table(self, text: str, iteration: int = 0) -> None:
        """The resolved per-layer, per-role policy table (and the policy file) as preformatted text."""
        self.log_text(POLICY_TAG, text, iteration)

    def log_text(self, tag: str, text: str, iteration: int = 0) -> None:
        # TensorBoard renders text as Markdown: a 4-space indent keeps the table's columns aligned.
        preformatted = "\n".join("    " + line for line in text.splitlines())
        self._writer.add_text(tag, preformatted, iteration)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def open_tensorboard(log_dir: str | None, *, is_writer_rank: bool,
                     max_queue: int = DEFAULT_MAX_QUEUE) -> TensorBoardLogger | NullTensorBoard:
    """A logger on the writer rank when ``log_dir`` is set; a no-op otherwise.

    Every rank checks that the package is importable when ``log_dir`` is set, so a missing package stops
    the whole job at start-up rather than one rank mid-run.
    """
    if not log_dir:
        return NullTensorBoard()
    writer_class = _summary_writer_class()
    if not is_writer_rank:
        return NullTensorBoard()
    return TensorBoardLogger(log_dir, max_queue=max_queue, writer_class=writer_class)


def _scalars(record: Mapping):
    """The record's (key, value) pairs, with the thread rows as ``host_threads/<name>/cpu_seconds`` and
    ``.../wait_seconds`` (the main thread as ``main``; rows of one name, e.g. a process's unnamed Python threads,
    summed into one tag, so that no tag gets two values per step)."""
    for key, value in record.items():
        if key != THREADS_KEY or value is None:
            yield key, value
            continue
        by_name: dict[str, list[float]] = {}
        for row in value:
            total = by_name.setdefault("main" if row["main"] else row["name"], [0.0, 0.0])
            total[0] += row["cpu_seconds"]
            total[1] += row["wait_seconds"]
        for name, (cpu_seconds, wait_seconds) in by_name.items():
            yield f"{key}/{name}/cpu_seconds", cpu_seconds
            yield f"{key}/{name}/wait_seconds", wait_seconds
