"""Hugging Face LLaMA checkpoints in and out (issue 22 item 2), against ``transformers`` itself, on CPU.

A tiny ``LlamaForCausalLM`` is built here from a random init (no download) with settings that differ from
agoq's defaults wherever a mapping could go wrong: GQA (4 query heads, 2 KV groups), RMSNorm eps 1e-6,
RoPE theta 50000, random RMSNorm gains, an untied head, a vocabulary (the size of a BPE tokenizer trained
here by ``tokenizers``) that Megatron pads to 384 rows, and sharded safetensors.

Tolerance (fp32 logits). agoq's model and transformers' compute the same fp32 function with other
kernels and orders: one fused QKV and one fused gate/up matmul instead of three and two (other summation
blocking), torch's RMSNorm vs HF's ``x * rsqrt(mean(x^2) + eps)``, RoPE's cos/sin from ``outer`` vs a
matmul. Each can differ by a rounding or two (fp32 unit roundoff 6e-8) per element; through 4 layers that
stays below ~1e-6 of the logits' scale; TP=2 adds the row-parallel layers' partial sums in another order (an
all-reduce). Measured on the CI CPU (1 thread per rank): bit-identical logits at TP=1 and PP=2 (difference 0),
1.1e-6 of the largest logit at TP=2. LOGITS_REL = 2e-5 of the largest logit leaves room for other CPUs / BLAS
builds and stays far below any mapping error: a swapped gate/up, a mis-grouped query head or the other RoPE
half convention changes the logits by O(1) of their scale (tests/unit/test_convert_llama.py pins the layouts
exactly).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agoq.testing.dist import spawn_ranks
from agoq.testing.hf import stdlib_texts, train_bpe_tokenizer
from agoq.testing.procs import REPO_ROOT, child_env, iteration_records, run_pretrain

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

LOGITS_REL = 2e-5
SEQ, BATCH = 24, 2
HF_SETTINGS = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=64,
                   tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
TOKENIZER_VOCAB = 300  # -> 384 rows in Megatron (multiple of 128)


def _tiny_hf_model(vocab_size: int, bos: int, eos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, **HF_SETTINGS)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # gains away from 1 so that a misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, TOKENIZER_VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens()).logits


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got[..., : want.shape[-1]].float()
    err = (got - want).abs().max().item() / want.abs().max().item()
    print(f"{what}: max |logit difference| / max |logit| = {err:.2e}")
    assert err < LOGITS_REL, f"{what}: logits differ by {err:.2e} of their scale (tolerance {LOGITS_REL})"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(HF directory with sharded fp32 safetensors + tokenizer files, its logits on _tokens())."""
    root = tmp_path_factory.mktemp("hf")
    tok_path = train_bpe_tokenizer(root / "tiny" / "tokenizer.json", TOKENIZER_VOCAB)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    model = _tiny_hf_model(TOKENIZER_VOCAB, bos, eos)
    model.save_pretrained(root / "tiny", max_shard_size="200KB")
    assert (root / "tiny" / "model.safetensors.index.json").is_file()  # sharded
    with torch.no_grad():
        logits = model(_tokens()).logits
    return root / "tiny", logits


def _convert(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "agoq.convert", *argv], capture_output=True, text=True,
                          env=child_env(), cwd=REPO_ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    """``python -m agoq.convert hf-to-agoq`` (the CLI, as a user runs it) of the tiny model."""
    hf_dir, _ = hf_model
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    proc = _convert("hf-to-agoq", str(hf_dir), "--output", str(out))
    assert "padded to 384 rows" in proc.stdout, proc.stdout
    return out


@pytest.fixture(scope="module")
def converted_tp2(hf_model, tmp_path_factory):
    """The same model converted for TP=2: the vocabulary padded to a multiple of 128 x 2 (512 rows)."""
    hf_dir, _ = hf_model
    out = tmp_path_factory.mktemp("ckpt") / "tiny_tp2"
    proc = _convert("hf-to-agoq", str(hf_dir), "--output", str(out), "--tensor-model-parallel-size", "2")
    assert "padded to 512 rows" in proc.stdout, proc.stdout
    return out


# ---------------------------------------------------------------------------------------------------
# TP=1 (one process): logits, and export -> import -> export


def _megatron_logits(chunks, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward of one batch through this rank's chunks with Megatron's schedule (forward only); the last
    pipeline stage returns the logits [b, s, padded vocab], other stages None."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)}

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        output = model(data["tokens"], data["position_ids"], None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach().clone()})

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=chunks, num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)  # fmt: skip
    return out[0]["logits"] if parallel_state.is_pipeline_last_stage() else None


def _tp1_worker(rank, world_size, ckpt: str, out_dir: str, tokenizer: str):
    """Logits of the converted checkpoint, then the CLI's export / import in this process."""
    from agoq.convert.__main__ import _shape, main
    from agoq.convert.llama import LlamaDims
    from agoq.megatron import runtime
    from agoq.megatron.ckpt import hf_checkpoint

    hf_checkpoint.init_single_process(runtime.SINGLE_PROCESS)
    source = hf_checkpoint.checkpoint_source(ckpt)
    extras = hf_checkpoint.saved_extras(source)
    shape = _shape(LlamaDims(**extras["hf_dims"]), extras["padded_vocab_size"])
    chunks = hf_checkpoint.build_model(shape, torch.float32)
    hf_checkpoint.load_weights(chunks, source)
    logits = _megatron_logits(chunks, _tokens())
    out = Path(out_dir)
    runs = [
        ["agoq-to-hf", ckpt, "--output", str(out / "hf1"), "--dtype", "fp32", "--tokenizer-model", tokenizer],
        ["hf-to-agoq", str(out / "hf1"), "--output", str(out / "ckpt2")],
        ["agoq-to-hf", str(out / "ckpt2"), "--output", str(out / "hf2"), "--dtype", "fp32"],
        ["agoq-to-hf", str(out / "ckpt2"), "--output", str(out / "hf2_sharded"), "--dtype", "fp32",
         "--max-shard-size", "300000"],
        ["agoq-to-hf", ckpt, "--output", str(out / "hf_bf16"), "--dtype", "bf16"],
    ]
    for argv in runs:
        assert main(argv) == 0, argv
    return logits


def test_tp1_logits_match_transformers_and_round_trip_is_bit_identical(hf_model, converted, tmp_path):
    from agoq.convert import hf_io

    hf_dir, want = hf_model
    yaml_text = (converted / "model.yaml").read_text()
    for line in ("num_query_groups: 2", "rotary_base: 50000", "norm_epsilon: 1.0e-06", "ffn_hidden_size: 160",
                 "seq_length: 64"):
        assert line in yaml_text, yaml_text
    logits = spawn_ranks(1, _tp1_worker, args=(str(converted), str(tmp_path), str(hf_dir / "tokenizer.json")))[0]
    assert logits.shape == (BATCH, SEQ, 384)
    assert_logits_close(logits, want, "agoq TP=1 vs transformers")

    original = hf_io.read_state_dict(hf_dir)
    exported = hf_io.read_state_dict(tmp_path / "hf1")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():  # fp32 in, fp32 out: the mapping only moves values
        assert torch.equal(exported[name], tensor), name
    assert (tmp_path / "hf1" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    config = json.loads((tmp_path / "hf1" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)  # from the tokenizer file
    assert torch.equal(hf_logits(tmp_path / "hf1"), want)  # transformers loads the export: the same model
    # export -> import -> export: byte-identical files; a sharded export holds the same tensors
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name
    assert (tmp_path / "hf2_sharded" / "model.safetensors.index.json").is_file()
    sharded = hf_io.read_state_dict(tmp_path / "hf2_sharded")
    assert sorted(sharded) == sorted(exported) and all(torch.equal(sharded[n], t) for n, t in exported.items())
    bf16 = hf_io.read_state_dict(tmp_path / "hf_bf16")
    assert all(bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], t.bfloat16()) for n, t in original.items())
    assert json.loads((tmp_path / "hf_bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------------------
# PP=2 (two gloo ranks): the converted checkpoint read into the trainer's pipeline layout


def _logits_in_layout(layout, ckpt: str):
    """This rank's logits of ``ckpt`` read into ``layout`` (vocabulary shards of TP ranks gathered)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from agoq.convert.__main__ import _shape
    from agoq.convert.llama import LlamaDims
    from agoq.megatron import runtime
    from agoq.megatron.ckpt import hf_checkpoint

    runtime.init_model_parallel(layout, seed=0, device=torch.device("cpu"))
    try:
        source = hf_checkpoint.checkpoint_source(ckpt)
        extras = hf_checkpoint.saved_extras(source)
        shape = _shape(LlamaDims(**extras["hf_dims"]), extras["padded_vocab_size"])
        chunks = hf_checkpoint.build_model(shape, torch.float32, layout)
        hf_checkpoint.load_weights(chunks, source)
        logits = _megatron_logits(chunks, _tokens())
        if layout.tp > 1:  # Megatron's output layer keeps each TP rank's vocabulary shard (parallel_output)
            shards = [torch.empty_like(logits) for _ in range(layout.tp)]
            dist.all_gather(shards, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            logits = torch.cat(shards, dim=-1)
        return logits
    finally:
        parallel_state.destroy_model_parallel()


def _two_rank_worker(rank, world_size, ckpt: str, ckpt_tp2: str):
    from agoq.config import AgoqConfig
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    install(AgoqConfig(enabled=False, device="cpu"))
    pp2 = _logits_in_layout(ParallelLayout(pp=2), ckpt)
    tp2 = _logits_in_layout(ParallelLayout(tp=2), ckpt_tp2)
    return pp2, tp2


def test_pp2_and_tp2_logits_match_transformers(hf_model, converted, converted_tp2):
    """The converted checkpoint read into PP=2 (the 384-row one) and TP=2 (converted for it: 512 rows; QKV and
    the gated fc1 cut by Megatron's sharded state dict) on two gloo ranks."""
    _, want = hf_model
    (pp_first, tp_0), (pp_last, tp_1) = spawn_ranks(2, _two_rank_worker, args=(str(converted), str(converted_tp2)))
    assert pp_first is None
    assert_logits_close(pp_last, want, "agoq PP=2 vs transformers")
    assert tp_0.shape == (BATCH, SEQ, 512) and torch.equal(tp_0, tp_1)
    assert_logits_close(tp_0, want, "agoq TP=2 vs transformers")


# ---------------------------------------------------------------------------------------------------
# The trainer: a converted checkpoint trains (PP=2, data prepared with the HF tokenizer.json), then exports


def _prepare_data(tokenizer: Path, out: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("agoq_script_prepare_data", REPO_ROOT / "scripts" / "prepare_data.py")
    prepare_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_data)
    jsonl = out / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts() * 8))
    prefix = out / "docs"
    assert prepare_data.main(["--input", str(jsonl), "--tokenizer-model", str(tokenizer),
                              "--output-prefix", str(prefix)]) == 0  # fmt: skip
    # every document is its ids (no template, no BOS) + the file's end-of-text id (1), as SentencePiece data
    import numpy as np

    from agoq.data.indexed import read_index
    from agoq.data.tokenizer import Tokenizer

    data, tok = read_index(prefix), Tokenizer.load(tokenizer)
    tokens = np.fromfile(data.bin_path, dtype=data.dtype)
    ends = np.cumsum(data.sequence_lengths) - 1
    assert tok.eod_id == 1 and (tokens[ends] == 1).all() and (tokens == 1).sum() == len(ends)
    first = stdlib_texts()[0]
    assert tokens[: ends[0] + 1].tolist() == tok.encode(first) + [1]
    return prefix


def _first_batch_loss(hf_dir: Path, prefix: Path, cache: Path, padded: int) -> float:
    """The tiny HF model's loss on the trainer's first global batch (the same GPTDataset iterator, seed and
    split: agoq.train.data.build_data_iterators), over Megatron's padded vocabulary (the padded rows'
    logits are 0), token-averaged as Megatron's loss is. A fresh init would give ~ln(padded) instead."""
    from transformers import AutoModelForCausalLM

    from agoq.data.tokenizer import Tokenizer
    from agoq.train import data as mdata

    train, _, _ = mdata.build_data_iterators(
        [str(prefix)], Tokenizer.load(hf_dir / "tokenizer.json"), seq_length=TRAIN_SEQ, micro_batch_size=TRAIN_MBS,
        global_batch_size=TRAIN_GBS, dp_rank=0, dp_size=1, train_iters=TRAIN_ITERS, seed=TRAIN_SEED,
        split=TRAIN_SPLIT, consumed_samples=0, cache_dir=cache / "indices-test", is_built_on_rank=lambda: True)
    batches = [next(train) for _ in range(TRAIN_GBS // TRAIN_MBS)]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["tokens"]).logits
            logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], padded - logits.shape[-1])], dim=-1)
            losses = torch.nn.functional.cross_entropy(logits.reshape(-1, padded), batch["labels"].reshape(-1),
                                                       reduction="none")  # fmt: skip
            total += (losses * batch["loss_mask"].reshape(-1)).sum().item()
            count += batch["loss_mask"].sum().item()
    return total / count


TRAIN_SEQ, TRAIN_MBS, TRAIN_GBS, TRAIN_ITERS, TRAIN_SEED, TRAIN_SPLIT = 32, 2, 4, 3, 1234, "90,5,5"
FIRST_LOSS_ABS = 1e-4  # nats: fp32 logits equal (tests above); Megatron's vocab-parallel cross entropy vs torch's


def test_converted_checkpoint_trains_with_hf_tokenizer_and_exports(hf_model, converted, tmp_path):
    """scripts/pretrain_llama.py --load <converted> (PP=2, agoq's default policy, fp32) on data that
    prepare_data.py wrote with the model's tokenizer.json (issue 22 item 3: EOD from the file, 300 tokens
    padded to the checkpoint's 384 rows): its iteration-1 loss is the HF model's loss on the same batch (measured
    6.916903 both); then agoq-to-hf of the trained PP=2 checkpoint loads in transformers."""
    hf_dir, _ = hf_model
    tokenizer = hf_dir / "tokenizer.json"
    prefix = _prepare_data(tokenizer, tmp_path)
    run = tmp_path / "run"
    args = ["--config", str(converted / "model.yaml"), "--pipeline-model-parallel-size", "2", "--fp32",
            "--load", str(converted), "--save", str(run), "--data-path", str(prefix),
            "--tokenizer-model", str(tokenizer),
            "--seq-length", str(TRAIN_SEQ), "--micro-batch-size", str(TRAIN_MBS), "--global-batch-size", str(TRAIN_GBS),
            "--train-iters", str(TRAIN_ITERS), "--seed", str(TRAIN_SEED), "--split", TRAIN_SPLIT,
            "--lr", "1e-3", "--lr-warmup-iters", "1"]  # fmt: skip
    proc = run_pretrain(2, args, env=child_env(AGOQ_CACHE=str(tmp_path / "cache")))
    assert "holds model weights only (a converted checkpoint)" in proc.stdout, proc.stdout[-3000:]
    losses = [r["loss"] for r in iteration_records(proc.stdout)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), proc.stdout[-3000:]
    expected = _first_batch_loss(hf_dir, prefix, tmp_path, 384)
    print(f"iteration-1 loss {losses[0]:.6f}, the HF model's on the same batch {expected:.6f}")
    assert expected > math.log(384) + 0.5  # a fresh init (std 0.02) would give ln(384) within ~0.01
    assert abs(losses[0] - expected) < FIRST_LOSS_ABS, (losses, expected)

    out = tmp_path / "hf_trained"
    _convert("agoq-to-hf", str(run), "--config", str(converted / "model.yaml"), "--tokenizer-model", str(tokenizer),
             "--output", str(out), "--dtype", "fp32")  # fmt: skip
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    delta = (trained.lm_head.weight - original.lm_head.weight).abs().max().item()
    assert 0 < delta < 0.05, delta  # 3 Adam steps at lr <= 1e-3 moved the weights, a little
    assert (out / "tokenizer.json").is_file()


# ---------------------------------------------------------------------------------------------------
# LLaMA-3.1 / 3.2 / 3.3 (issue 42): scaled RoPE (rope_type llama3), tied embeddings, eos lists, generation config.
# Two random configs shaped like the released ones (head dim 16 at RoPE base 500000: the llama3 bands keep 4
# frequencies, blend 1 and divide 3, so every branch of the scaling is in the logits):
#   3.2-1B-like: tied embeddings, factor 32;  3.1-8B-like: untied, factor 8.
# Both with an eos list and a generation_config.json that are not transformers' defaults.

EOS_LIST = [1, 298, 299]
LLAMA3_VARIANTS = {
    "llama3.2-1b-like": dict(tie_word_embeddings=True, factor=32.0),
    "llama3.1-8b-like": dict(tie_word_embeddings=False, factor=8.0),
}


def _llama3_hf_model(variant: str):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from agoq.ref.rope import LLAMA3_ROPE_FIXED

    settings = LLAMA3_VARIANTS[variant]
    torch.manual_seed(1)
    config = LlamaConfig(**{**HF_SETTINGS, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                            "tie_word_embeddings": settings["tie_word_embeddings"]},
                         vocab_size=TOKENIZER_VOCAB, bos_token_id=0, eos_token_id=EOS_LIST,
                         rope_scaling={"rope_type": "llama3", "factor": settings["factor"], **LLAMA3_ROPE_FIXED})
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=EOS_LIST, do_sample=True,
                                               temperature=0.6, top_p=0.9)
    return model


def _save_llama3(variant: str, root: Path, tokenizer: Path):
    """(variant, HF directory with the tiny model's tokenizer, its fp32 logits, its parameter count)."""
    import shutil

    model = _llama3_hf_model(variant)
    model.save_pretrained(root / "hf", max_shard_size="200KB")
    shutil.copy(tokenizer, root / "hf" / "tokenizer.json")
    with torch.no_grad():
        logits = model(_tokens()).logits
    return variant, root / "hf", logits, model.num_parameters()


@pytest.fixture(scope="module", params=sorted(LLAMA3_VARIANTS))
def llama3_model(request, tmp_path_factory, hf_model):
    return _save_llama3(request.param, tmp_path_factory.mktemp(request.param), hf_model[0] / "tokenizer.json")


def _llama3_worker(rank, world_size, hf_dir: str, out_dir: str):
    """hf-to-agoq, the converted model's logits (agoq's fused QKV RoPE in Megatron's slot: the kernel's path), the
    model's parameter count, then agoq-to-hf and the round trip's hf-to-agoq and logits again."""
    from agoq.convert.__main__ import _shape, main
    from agoq.convert.llama import LlamaDims
    from agoq.megatron import install, model, runtime
    from agoq.megatron.ckpt import hf_checkpoint

    hf_checkpoint.init_single_process(runtime.SINGLE_PROCESS)
    out = Path(out_dir)

    def logits_of(ckpt: Path):
        source = hf_checkpoint.checkpoint_source(ckpt)
        extras = hf_checkpoint.saved_extras(source)
        shape = _shape(LlamaDims(**extras["hf_dims"]), extras["padded_vocab_size"])
        config = model.llama_transformer_config(shape, model.ParallelLayout(), params_dtype=torch.float32,
                                                use_cpu_initialization=True, rope_fusion=True)
        try:
            chunks = model.build_model_chunks(shape, config, model.agoq_layer_spec("sdpa"), None)
            hf_checkpoint.load_weights(chunks, source)
            count = sum(p.numel() for p in chunks[0].parameters())
            return _megatron_logits(chunks, _tokens()), count, shape, extras
        finally:
            install.undo_runtime_changes()

    assert main(["hf-to-agoq", hf_dir, "--output", str(out / "ckpt")]) == 0
    first = logits_of(out / "ckpt")
    assert main(["agoq-to-hf", str(out / "ckpt"), "--output", str(out / "hf1"), "--dtype", "fp32"]) == 0
    assert main(["hf-to-agoq", str(out / "hf1"), "--output", str(out / "ckpt2")]) == 0
    second = logits_of(out / "ckpt2")
    assert main(["agoq-to-hf", str(out / "ckpt2"), "--output", str(out / "hf2"), "--dtype", "fp32"]) == 0
    return first, second


def test_llama3_logits_match_transformers_before_and_after_a_round_trip(llama3_model, tmp_path):
    """fp32 logits of the converted checkpoint (through agoq's fused RoPE) equal transformers' within LOGITS_REL
    (module docstring; measured bit-identical), before and after HF -> agoq -> HF -> agoq; the parameter count is the
    HF model's (tied: one table, plus the padded rows); tying, rope_scaling, the eos list and generation_config.json
    survive the round trip, and the export's tensors are the original ones bit for bit."""
    from transformers import AutoConfig

    from agoq.convert import hf_io

    variant, hf_dir, want, hf_count = llama3_model
    tied = LLAMA3_VARIANTS[variant]["tie_word_embeddings"]
    (logits, count, shape, extras), (logits2, count2, _, _) = spawn_ranks(
        1, _llama3_worker, args=(str(hf_dir), str(tmp_path)))[0]
    assert shape.rope_scaling and shape.rope_scaling_factor == LLAMA3_VARIANTS[variant]["factor"]
    assert shape.share_embeddings_and_output_weights is tied and shape.rotary_base == 500000
    assert extras["resume_contract"]["share_embeddings_and_output_weights"] is tied  # the trainer checks it
    padding = (384 - TOKENIZER_VOCAB) * HF_SETTINGS["hidden_size"] * (1 if tied else 2)
    assert count == count2 == hf_count + padding == shape.num_parameters()
    assert_logits_close(logits, want, f"{variant}: agoq vs transformers")
    assert torch.equal(logits2, logits)  # the round trip moved no value
    # the scaling is in these logits: plain RoPE at the same base gives other logits, far outside the tolerance
    plain_config = json.loads((hf_dir / "config.json").read_text())
    from transformers import LlamaConfig, LlamaForCausalLM

    plain_config.pop("rope_scaling", None)
    plain_config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    plain = LlamaForCausalLM.from_pretrained(hf_dir, config=LlamaConfig(**plain_config), dtype=torch.float32).eval()
    with torch.no_grad():
        off = (plain(_tokens()).logits - want).abs().max().item() / want.abs().max().item()
    print(f"{variant}: plain RoPE instead of llama3 scaling changes the logits by {off:.2e} of their scale")
    assert off > 50 * LOGITS_REL, off

    for exported in (tmp_path / "hf1", tmp_path / "hf2"):
        original, state = hf_io.read_state_dict(hf_dir), hf_io.read_state_dict(exported)
        assert sorted(state) == sorted(original) and ("lm_head.weight" in state) is not tied
        assert all(torch.equal(state[k], v) for k, v in original.items())
        config = AutoConfig.from_pretrained(exported)
        assert config.tie_word_embeddings is tied and config.eos_token_id == EOS_LIST
        rope = getattr(config, "rope_parameters", None) or config.rope_scaling
        assert (rope["rope_type"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                rope["original_max_position_embeddings"]) == ("llama3", LLAMA3_VARIANTS[variant]["factor"], 1.0, 4.0,
                                                              8192)  # fmt: skip
        assert json.loads((exported / "generation_config.json").read_text()) == \
            json.loads((hf_dir / "generation_config.json").read_text())
    assert torch.equal(hf_logits(tmp_path / "hf2"), want)  # transformers loads the export: the same model


def test_converted_tied_scaled_checkpoint_trains_at_pp2_and_exports_from_its_record(hf_model, tmp_path):
    """The LLaMA-3.2-1B-like checkpoint (tied, llama3 RoPE factor 32) trains under scripts/pretrain_llama.py at PP=2,
    where the last stage holds Megatron's copy of the shared weight: its iteration-1 loss is the HF model's on the
    same batch, and iterations 1-3 equal a PP=1 run's (the copies stay equal: Megatron's embedding-group all-reduce).
    agoq-to-hf of the trained checkpoint needs no --config: the run record holds the whole shape (base, scaling,
    epsilon, tying) and the converted model's eos list and generation config; a --config that disagrees with the
    record is an error naming both values."""
    _, hf_dir, _, _ = _save_llama3("llama3.2-1b-like", tmp_path, hf_model[0] / "tokenizer.json")
    ckpt = tmp_path / "ckpt"
    proc = _convert("hf-to-agoq", str(hf_dir), "--output", str(ckpt))
    assert "model: RoPE base 500000, llama3 scaling factor 32; embeddings tied" in proc.stdout, proc.stdout
    yaml_text = (ckpt / "model.yaml").read_text()
    assert "use_rope_scaling: true\nrope_scaling_factor: 32.0\n" in yaml_text
    assert "untie_embeddings_and_output_weights: false\n" in yaml_text
    tokenizer = hf_dir / "tokenizer.json"
    prefix = _prepare_data(tokenizer, tmp_path)
    common = ["--config", str(ckpt / "model.yaml"), "--fp32", "--load", str(ckpt), "--data-path", str(prefix),
              "--tokenizer-model", str(tokenizer), "--seq-length", str(TRAIN_SEQ), "--micro-batch-size",
              str(TRAIN_MBS), "--global-batch-size", str(TRAIN_GBS), "--train-iters", str(TRAIN_ITERS), "--seed",
              str(TRAIN_SEED), "--split", TRAIN_SPLIT, "--lr", "1e-3", "--lr-warmup-iters", "1",
              # int8 activations at every site: the same storage at PP=1 and PP=2 (agoq.yaml's auto bits follow the
              # stage, which would make the layouts differ by design)
              "--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "int8.yaml")]  # fmt: skip
    env = child_env(AGOQ_CACHE=str(tmp_path / "cache"))
    run = tmp_path / "run"
    pp2 = run_pretrain(2, [*common, "--pipeline-model-parallel-size", "2", "--save", str(run)], env=env)
    assert "embeddings tied (--tie-embeddings-and-output-weights)" in pp2.stdout, pp2.stdout[-3000:]
    assert "RoPE base 500000 scaled by 32 (--use-rope-scaling)" in pp2.stdout, pp2.stdout[-3000:]
    pp1 = run_pretrain(1, common, env=env)
    losses, losses_pp1 = ([r["loss"] for r in iteration_records(p.stdout)] for p in (pp2, pp1))
    expected = _first_batch_loss(hf_dir, prefix, tmp_path, 384)
    print(f"tied + scaled: losses PP=2 {losses}, PP=1 {losses_pp1}; the HF model's first-batch loss {expected:.6f}")
    assert len(losses) == TRAIN_ITERS and abs(losses[0] - expected) < FIRST_LOSS_ABS, (losses, expected)
    assert losses[2] != losses[0]  # it trains
    # fp32, the same weights, batches and storage: PP=1 and PP=2 differ at most in summation order (measured: equal
    # printed losses). Without the last stage's copy kept equal (Megatron's embedding-group all-reduce of the shared
    # weight's gradient) the losses would differ from iteration 2 on.
    assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(losses, losses_pp1, strict=True)), (losses, losses_pp1)

    out = tmp_path / "hf_trained"
    _convert("agoq-to-hf", str(run), "--output", str(out), "--dtype", "fp32")  # no --config: the record
    config = json.loads((out / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["rope_theta"], config["eos_token_id"]) == (True, 500000.0, EOS_LIST)
    assert config["rope_scaling"]["factor"] == 32.0 and config["rms_norm_eps"] == HF_SETTINGS["rms_norm_eps"]
    assert json.loads((out / "generation_config.json").read_text()) == \
        json.loads((hf_dir / "generation_config.json").read_text())
    from transformers import AutoModelForCausalLM

    from agoq.convert import hf_io

    assert "lm_head.weight" not in hf_io.read_state_dict(out)
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert trained.num_parameters() == original.num_parameters()
    delta = (trained.model.embed_tokens.weight - original.model.embed_tokens.weight).abs().max().item()
    assert 0 < delta < 0.05, delta
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml_text.replace("rotary_base: 500000", "rotary_base: 10000"))
    proc = subprocess.run([sys.executable, "-m", "agoq.convert", "agoq-to-hf", str(run), "--config", str(wrong),
                           "--output", str(tmp_path / "never")], capture_output=True, text=True, env=child_env(),
                          cwd=REPO_ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{wrong}: rotary_base 10000, but the checkpoint was saved with rotary_base 500000" in proc.stderr
    assert not (tmp_path / "never").exists()
