"""megatron-core's dataset pieces agoq's trainer uses: its ``.bin/.idx`` writer and paths, the token dtype, and
``GPTDataset``s built by ``BlendedMegatronDatasetBuilder`` over an agoq :class:`~agoq.data.tokenizer.Tokenizer`
(seen through :class:`AgoqMegatronTokenizer`). agoq.train.data builds the datasets and iterators on them.

Seam card
---------
Touches (megatron-core 0.19.2): ``datasets.indexed_dataset`` (``IndexedDatasetBuilder``, ``DType.optimal_dtype``,
  ``get_bin_path`` / ``get_idx_path``), ``datasets.gpt_dataset`` (``GPTDataset``, ``GPTDatasetConfig``),
  ``datasets.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder``, ``tokenizers.MegatronTokenizerBase``
  (subclassed: :class:`AgoqMegatronTokenizer`).
Why: Megatron's datasets give the trainer Megatron-LM's sample order, blending and index caches.
Guarded by: tests/megatron/test_data.py.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.tokenizers import MegatronTokenizerBase

from agoq.data.tokenizer import Tokenizer

# Part of the index caches' key (unique_identifiers): the adapter's name when the key was first written, kept as it
# was so that the caches built before this class moved here stay valid.
CACHE_CLASS_NAME = "agoq.train.data.AgoqMegatronTokenizer"


class AgoqMegatronTokenizer(MegatronTokenizerBase):
    """An agoq :class:`Tokenizer` seen as the tokenizer ``GPTDatasetConfig`` expects.

    GPTDataset reads ``vocab_size`` (token dtype), ``eod`` (loss/position masks), ``pad`` (padding
    mask; -1 = none) and ``unique_identifiers`` (part of the index-cache hash, so a new tokenizer
    never reuses an old cache).
    """

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(str(tokenizer.path) if tokenizer.path else "<in-memory>", {})
        self.tokenizer = tokenizer
        self.unique_identifiers = OrderedDict([("class", CACHE_CLASS_NAME), ("sha256", tokenizer.sha256)])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def vocab(self) -> dict:
        return {self.tokenizer.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        return self.tokenizer.eod_id

    @property
    def eos(self) -> int:
        return self.tokenizer.eod_id

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_id

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("agoq's pretraining tokenizer has no chat template")


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 below 65500 pieces, else int32 (Megatron's ``DType.optimal_dtype``)."""
    return DType.optimal_dtype(vocab_size)


def bin_path(prefix: str) -> str:
    """The ``.bin`` file (token ids) of an indexed dataset ``prefix``."""
    return get_bin_path(prefix)


def idx_path(prefix: str) -> str:
    """The ``.idx`` file (document index) of an indexed dataset ``prefix``."""
    return get_idx_path(prefix)


def indexed_writer(prefix: str, vocab_size: int) -> IndexedDatasetBuilder:
    """Megatron's writer of ``prefix``'s ``.bin`` (``add_document``; ``finalize(idx_path(prefix))`` writes the
    ``.idx``), token ids in :func:`token_dtype`."""
    return IndexedDatasetBuilder(get_bin_path(prefix), dtype=token_dtype(vocab_size))


def gpt_datasets(prefixes: list[str], weights: list[float] | None, tokenizer: Tokenizer,
                 num_samples: Sequence[int | None], *, seq_length: int, seed: int, split: str,
                 cache_dir: str | os.PathLike, is_built_on_rank: Callable[[], bool] | None, mmap_bin_files: bool,
                 eod_mask_loss: bool) -> list:
    """``[train, valid, test]`` GPTDatasets over the blend ``prefixes`` / ``weights`` (None for empty splits or ranks
    that do not build); index files cached under ``cache_dir``."""
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=os.fspath(cache_dir),
        mmap_bin_files=mmap_bin_files,
        tokenizer=AgoqMegatronTokenizer(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank or (lambda: True), config)
    return builder.build()
