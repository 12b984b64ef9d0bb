"""--sequence-parallel on the command line of scripts/pretrain_llama.py and python -m agoq.plan (issue 45 item 4): what
it needs and what does not compose with it, refused by name with the fix before torch loads; and the planner's model
of it (agoq.plan.storage: the residual stream's saves 1/TP per rank). The training runs:
tests/megatron/test_sequence_parallel.py."""

from __future__ import annotations

import pytest

from agoq.plan.__main__ import main as plan_main
from agoq.plan.storage import SEQUENCE_SHARDED_ROLES, LayerDims, head_saved_bytes, megatron_bytes
from agoq.train.args import parse_args
from tests.megatron._layouts import TINY

LLAMA_1B = ["--config", str(TINY.parent / "llama-1b.yaml"), "--vocab-size", "32000", "--seq-length", "4096",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--memory-budget", "80GiB"]


def test_the_trainer_takes_the_flag_with_tp():
    args = parse_args(["--config", str(TINY), "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert args.sequence_parallel is True
    assert parse_args(["--config", str(TINY)]).sequence_parallel is False


@pytest.mark.parametrize(("extra", "named"), [
    ([], "needs --tensor-model-parallel-size > 1 (got 1)"),
    (["--tensor-model-parallel-size", "2", "--seq-length", "33"], "--seq-length 33 divisible by"),
    (["--tensor-model-parallel-size", "2", "--agoq-disable"], "drop --agoq-disable"),
    (["--tensor-model-parallel-size", "2", "--agoq-fp8", "delayed"], "pass --agoq-fp8 off"),
])
def test_the_trainer_refuses_what_does_not_run_with_the_fix(capsys, extra, named):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(TINY), "--sequence-parallel", *extra])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_layer_dims_shard_only_the_residual_streams_roles():
    plain = LayerDims(seq=4096, micro_batch=2, hidden=2048, ffn=8192, heads=16, groups=8, tp=4)
    sp = LayerDims(seq=4096, micro_batch=2, hidden=2048, ffn=8192, heads=16, groups=8, tp=4, sequence_parallel=True)
    roles = ("norm.input", "attn.qkv_input", "mlp.fc1_input", "attn.proj_input", "mlp.swiglu_input", "mlp.fc2_input",
             "attn.q", "attn.k", "attn.v", "attn.out")
    for role in roles:
        assert sp.numel(role) * (4 if role in SEQUENCE_SHARDED_ROLES else 1) == plain.numel(role), role
    assert set(SEQUENCE_SHARDED_ROLES) == {"norm.input", "attn.qkv_input", "mlp.fc1_input"}
    # the head: the final norm's and the output layer's inputs and the norm's rstd sharded, the logits not
    t, h, v = plain.tokens, plain.hidden, 32000
    assert head_saved_bytes(plain, v) - head_saved_bytes(sp, v) == (2 * 2 * h + 4) * (t - t // 4)


def test_megatron_norm_bytes_shard_with_the_rstd():
    from agoq.plan.storage import layer_storage
    from agoq.policy import Site, load_policy

    bf16 = load_policy(TINY.parents[1] / "policy" / "bf16.yaml")
    storage = layer_storage(bf16, lambda role: Site(0, 0, 1, None, None, role), None)
    kw = dict(seq=1024, micro_batch=1, hidden=512, ffn=1024, heads=8, groups=2, tp=2)
    plain = megatron_bytes(storage, LayerDims(**kw))
    sp = megatron_bytes(storage, LayerDims(**kw, sequence_parallel=True))
    for role, nbytes in plain.items():
        assert sp[role] * (2 if role in SEQUENCE_SHARDED_ROLES else 1) == nbytes, role


def test_the_planner_models_it_and_says_so(capsys):
    small = [*LLAMA_1B, "--memory-budget", "8GiB", "--tensor-model-parallel-size", "2"]  # nothing fits: every row
    assert plan_main(small) == 3
    plain = capsys.readouterr().out
    assert plan_main([*small, "--sequence-parallel"]) == 3
    sp = capsys.readouterr().out
    assert "sequence parallelism over TP=2" in sp and "sequence parallelism" not in plain

    def held(out, name):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name) and "stage 0" in ln)
        return float(line.split("activations")[1].split()[0])

    for name in ("bf16", "agoq"):
        assert held(sp, name) < held(plain, name), name


@pytest.mark.parametrize(("extra", "named"), [
    ([], "needs --tensor-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2", "--agoq-fp8", "delayed"], "pass --agoq-fp8 off"),
    (["--gpus", "4"], "--gpus N searches layouts without sequence parallelism"),
])
def test_the_planner_refuses_what_the_trainer_refuses(capsys, extra, named):
    assert plan_main([*LLAMA_1B, "--sequence-parallel", *extra]) == 2
    assert named in capsys.readouterr().err
