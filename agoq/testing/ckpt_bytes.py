"""On-disk bytes of a Megatron torch_dist checkpoint, split into model, optimizer and the rest.

Reads the checkpoint's ``.metadata`` (torch.distributed.checkpoint): every stored item has a file,
offset and length, so the bytes each key occupies on disk are exact (serialised tensors and pickled
objects as written, not an estimate from dtypes). Keys starting with ``optimizer`` are the optimizer's
(Megatron's distributed optimizer and agoq's ``optimizer.agoq_state.*`` alike); ``rng_state`` and
``common_state`` go to ``other``. The parameter count is the number of elements of the model's
floating-point tensors (no ``_extra_state`` objects), so ``optimizer_bytes_per_param`` is directly
comparable between optimizers of the same model. ``optimizer_tensor_bytes`` counts only the optimizer
tensors' elements (numel x element size): the difference to ``optimizer_bytes`` is serialisation
(torch.save framing of every saved slice, ~1 KB each, and pickled objects such as agoq's formats).

    python -m agoq.testing.ckpt_bytes CKPT_DIR/iter_0000003
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

OTHER_PREFIXES = ("rng_state", "common_state")


def checkpoint_bytes(iter_dir: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(iter_dir)).read_metadata()
    parts: dict[str, int] = defaultdict(int)
    for index, info in md.storage_data.items():
        key = index.fqn
        part = "optimizer" if key.startswith("optimizer") else ("other" if key.startswith(OTHER_PREFIXES) else "model")
        parts[part] += info.length
    payload = sum(  # the optimizer tensors' own bytes (numel x element size), without serialisation overhead
        math.prod(meta.size) * meta.properties.dtype.itemsize
        for key, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and key.startswith("optimizer")
    )
    params = sum(
        math.prod(meta.size)
        for key, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
        and not key.startswith(("optimizer",) + OTHER_PREFIXES)
        and meta.properties.dtype.is_floating_point
    )
    return dict(model_params=params, model_bytes=parts["model"], optimizer_bytes=parts["optimizer"],
                other_bytes=parts["other"], model_bytes_per_param=parts["model"] / params,
                optimizer_bytes_per_param=parts["optimizer"] / params, optimizer_tensor_bytes=payload,
                optimizer_tensor_bytes_per_param=payload / params)  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(checkpoint_bytes(sys.argv[1]), indent=1))
