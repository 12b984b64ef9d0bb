"""configs/model/*.yaml: every file parses as flags, has its published shape and size, and fits its layout.

Each model config states the layout it is meant for in a comment line ``# layout: N GPUs (TP=.., PP=..)``;
the tensor/pipeline sizes themselves are YAML keys. These tests hold the files to that comment and to
the published shapes cited in their headers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from agoq.train.args import parse_args

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
LAYOUT_LINE = re.compile(r"^# layout: (\d+) GPUs? \(TP=(\d+), PP=(\d+)", re.MULTILINE)
# Published totals are rounded in their sources (e.g. "6.7B", "1.23B"); 5 % also covers the nominal
# GPT-3 size classes (125M, 350M) that the small configs borrow their depth and width from.
PARAM_REL_TOL = 0.05


@dataclass(frozen=True)
class Published:
    """Shape and size from the source cited in the config's header (layers, hidden, heads, kv, ffn)."""

    layers: int
    hidden: int
    heads: int
    kv_groups: int
    ffn: int
    vocab: int
    params: float  # as published, with the source's vocabulary
    tied_in_source: bool = False  # agoq never ties: the count then grows by vocab x hidden


PUBLISHED = {
    # arXiv 2307.09288 Table 1 + meta-llama/Llama-2-7b-hf config.json; 6,738,415,616 parameters.
    "llama2-7b.yaml": Published(32, 4096, 32, 32, 11008, 32000, 6.74e9),
    # arXiv 2307.09288 Table 1 + meta-llama/Llama-2-13b-hf config.json; 13,015,864,320 parameters.
    "llama2-13b.yaml": Published(40, 5120, 40, 40, 13824, 32000, 13.0e9),
    # arXiv 2407.21783 Table 3 + meta-llama/Meta-Llama-3-8B config.json; 8,030,261,248 parameters.
    "llama3-8b.yaml": Published(32, 4096, 32, 8, 14336, 128256, 8.03e9),
    # arXiv 2407.21783 Table 3 + meta-llama/Meta-Llama-3-70B config.json; 70,553,706,496 parameters.
    "llama3-70b.yaml": Published(80, 8192, 64, 8, 28672, 128256, 70.55e9),
    # Qwen2.5-32B: arXiv 2412.15115 Table 1 + config.json; model card "32.5B" (Qwen adds QKV biases).
    "llama-32b.yaml": Published(64, 5120, 40, 8, 27648, 152064, 32.5e9),
    # meta-llama/Llama-3.2-1B config.json; 1,235,814,400 parameters with tied embeddings.
    "llama-1b.yaml": Published(16, 2048, 32, 8, 8192, 128256, 1.2358e9, tied_in_source=True),
    # GPT-3 Small / Medium size classes (arXiv 2005.14165 Table 2.1), LLaMA form, 32000 vocabulary.
    "llama-125m.yaml": Published(12, 768, 12, 4, 2048, 32000, 125e6),
    "llama-350m.yaml": Published(24, 1024, 16, 4, 2816, 32000, 350e6),
}
NOT_PUBLISHED = {"tiny.yaml"}  # CI smoke model, no published counterpart


def _config_files() -> list[Path]:
    return sorted(CONFIG_DIR.glob("*.yaml"))


def _args(path: Path, *extra: str):
    return parse_args(["--config", str(path), *extra])


def test_every_config_is_covered_by_this_test():
    names = {p.name for p in _config_files()}
    assert names == set(PUBLISHED) | NOT_PUBLISHED, "add new configs to PUBLISHED (with the source) or NOT_PUBLISHED"


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: p.name)
def test_config_parses_and_sets_every_shape_key(path):
    args = _args(path)
    text = path.read_text()
    # Shape keys must be explicit: a derived default (e.g. ffn = 8/3 hidden) would hide a typo.
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "seq_length"):
        assert re.search(rf"^{key}: ", text, re.MULTILINE), f"{path.name}: set {key} explicitly"
    assert args.hidden_size % args.num_attention_heads == 0
    assert args.num_attention_heads % args.num_query_groups == 0
    head_dim = args.hidden_size // args.num_attention_heads
    assert head_dim % 2 == 0, "RoPE rotates pairs of channels"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_matches_published_shape_and_size(name):
    from agoq.megatron.model import LlamaShape

    ref = PUBLISHED[name]
    args = _args(CONFIG_DIR / name)
    got = (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups, args.ffn_hidden_size)
    assert got == (ref.layers, ref.hidden, ref.heads, ref.kv_groups, ref.ffn)
    shape = LlamaShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, vocab_size=ref.vocab,
    )
    expected = ref.params + (ref.vocab * ref.hidden if ref.tied_in_source else 0)
    assert shape.num_parameters() == pytest.approx(expected, rel=PARAM_REL_TOL)


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: p.name)
def test_config_fits_its_stated_layout(path):
    from agoq.megatron.model import LlamaShape, ParallelLayout
    from agoq.train.pretrain import num_microbatches

    if path.name in NOT_PUBLISHED:
        pytest.skip("smoke config: its layout is given on the command line")
    match = LAYOUT_LINE.search(path.read_text())
    assert match, f"{path.name}: add a '# layout: N GPUs (TP=t, PP=p ...)' comment"
    gpus, tp, pp = (int(g) for g in match.groups())
    args = _args(path)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp), "comment vs keys"
    layout = ParallelLayout(tp=tp, pp=pp, vpp=args.vpp)
    shape = LlamaShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, vocab_size=32000,
    )
    layout.check(shape, gpus)  # ValueError naming the flag if heads / groups / layers do not divide
    assert num_microbatches(args, layout, gpus) >= pp, "fewer micro-batches than stages: pipeline bubbles only"
