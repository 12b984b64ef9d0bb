"""Two gloo ranks: rank 0 builds the default dataset and the GPTDataset indices, the other waits and
reuses them; each data-parallel rank gets its slice of every global batch."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

from agoq.data.tokenizer import Tokenizer, TokenizerTrainConfig  # noqa: E402
from agoq.train.data import build_data_iterators, ensure_default_dataset  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
CAP_BYTES = 128 * 1024  # 31 documents of pydoc topics: ~50k tokens, builds in about a second
VOCAB = 512
ITERATOR_KWARGS = dict(seq_length=32, global_batch_size=8, train_iters=3, split="90,5,5")

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from agoq.data.tokenizer import Tokenizer, TokenizerTrainConfig
    from agoq.train.data import build_data_iterators, ensure_default_dataset_distributed

    rank, out = int(sys.argv[1]), Path(sys.argv[2])
    cap, vocab, kwargs = int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    paths = ensure_default_dataset_distributed(
        out / "cache", max_bytes=cap, tokenizer_config=TokenizerTrainConfig(vocab_size=vocab)
    )
    tokenizer = Tokenizer.load(paths.tokenizer_model)
    train, _, _ = build_data_iterators(
        paths.prefix, tokenizer, micro_batch_size=2, dp_rank=rank, dp_size=2,
        cache_dir=out / "cache" / "indices", **kwargs
    )
    torch.save([batch["tokens"] for batch in train], out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"prefix": str(paths.prefix)}))
    dist.destroy_process_group()
    """
)


def test_two_ranks_share_one_build_and_split_batches(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    args = [str(tmp_path), str(CAP_BYTES), str(VOCAB), json.dumps(ITERATOR_KWARGS)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank][-4000:]}"

    prefixes = {json.loads((tmp_path / f"rank{r}.json").read_text())["prefix"] for r in range(WORLD_SIZE)}
    assert len(prefixes) == 1
    built = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("stdlib-")]
    assert len(built) == 1 and not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]

    # One process, one rank holding both slices (micro-batch 4): the same global batches, in order.
    paths = ensure_default_dataset(
        tmp_path / "cache", max_bytes=CAP_BYTES, tokenizer_config=TokenizerTrainConfig(vocab_size=VOCAB)
    )
    assert str(paths.prefix) in prefixes
    single, _, _ = build_data_iterators(
        paths.prefix,
        Tokenizer.load(paths.tokenizer_model),
        micro_batch_size=4,
        dp_rank=0,
        dp_size=1,
        cache_dir=tmp_path / "cache" / "indices",
        **ITERATOR_KWARGS,
    )
    expected = [batch["tokens"] for batch in single]
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(expected) > 0
    for b0, b1, whole in zip(per_rank[0], per_rank[1], expected, strict=True):
        assert torch.equal(torch.cat([b0, b1]), whole)
