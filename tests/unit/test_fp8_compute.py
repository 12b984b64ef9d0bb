"""The FP8 / Smooth-SwiGLU settings: policy `fp8:` section, flags over the policy, the run checks (no
GPU, old GPU, Transformer Engine missing, GEMM dims) and the per-layer bf16 rule."""

from __future__ import annotations

import pytest
import torch

from agoq.config import AgoqConfig
from agoq.megatron.compute import check_compute, compute_report, fp8_recipe
from agoq.ops.fp8_scaling import DEFAULT_AMAX_HISTORY_LEN
from agoq.policy import FP8Spec, PolicyError, policy_from_dict
from agoq.policy.schema import FP8_DEFAULT_AMAX_HISTORY_LEN
from agoq.train.args import parse_args

BASE = {"version": 1, "default": {"activations": "bf16"}}
DIMS = dict(num_layers=4, hidden=64, ffn=192, heads=4, groups=2, tp=1, tokens_per_microbatch=256)


def test_policy_fp8_section_loads_and_absent_means_none():
    assert policy_from_dict(BASE).fp8 is None
    spec = policy_from_dict({**BASE, "fp8": {"recipe": "delayed", "smooth_swiglu": "per-token",
                                             "bf16_last_layers": 2, "amax_history_len": 64}})
    assert spec.fp8 == FP8Spec(recipe="delayed", smooth_swiglu="per-token", bf16_last_layers=2, amax_history_len=64)


@pytest.mark.parametrize("section,key", [({"recipe": "fp4"}, "fp8.recipe"),
                                         ({"smooth_swiglu": "on"}, "fp8.smooth_swiglu"),
                                         ({"bf16_first_layers": -1}, "fp8.bf16_first_layers"),
                                         ({"bf16_last_layers": True}, "fp8.bf16_last_layers"),
                                         ({"amax_history_len": 0}, "fp8.amax_history_len"),
                                         ({"margin": 1}, "fp8.margin")])
def test_policy_fp8_section_errors_cite_the_key(section, key):
    with pytest.raises(PolicyError, match=key.replace(".", r"\.")):
        policy_from_dict({**BASE, "fp8": section}, "p.yaml")


def test_default_history_length_matches_the_ops_default():
    assert FP8_DEFAULT_AMAX_HISTORY_LEN == DEFAULT_AMAX_HISTORY_LEN


@pytest.mark.parametrize("first,last,expected", [(1, 1, [1, 2]), (0, 0, [0, 1, 2, 3]), (2, 2, []), (0, 3, [0])])
def test_first_and_last_layers_stay_bf16(first, last, expected):
    spec = FP8Spec(recipe="current", bf16_first_layers=first, bf16_last_layers=last)
    assert [i for i in range(4) if spec.uses_fp8(i, 4)] == expected
    assert not any(FP8Spec(bf16_first_layers=0, bf16_last_layers=0).uses_fp8(i, 4) for i in range(4))  # off


def test_flags_override_the_policy_section():
    policy = policy_from_dict({**BASE, "fp8": {"recipe": "delayed", "smooth_swiglu": "per-token",
                                               "bf16_first_layers": 0}})
    flags = vars(parse_args(["--agoq-fp8", "rowwise", "--agoq-fp8-bf16-last-layers", "2"]))
    assert AgoqConfig.from_flags(flags, policy=policy).fp8 == FP8Spec(
        recipe="rowwise", smooth_swiglu="per-token", bf16_first_layers=0, bf16_last_layers=2)
    assert AgoqConfig.from_flags({}, policy=None).fp8 == FP8Spec()  # nothing given: off
    assert parse_args([]).agoq_config.fp8 == FP8Spec()  # the default policy has no fp8 section
    with pytest.raises(ValueError, match="--agoq-fp8-amax-history-len"):
        AgoqConfig.from_flags({"agoq_fp8_amax_history_len": 0})


def test_agoq_disable_rejects_fp8_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--agoq-disable", "--agoq-smooth-swiglu", "per-token"])
    assert "--agoq-smooth-swiglu" in capsys.readouterr().err


def test_recipes_map_to_ops_recipes():
    assert fp8_recipe(FP8Spec()) is None
    assert fp8_recipe(FP8Spec(recipe="delayed", amax_history_len=32)).amax_history_len == 32
    assert fp8_recipe(FP8Spec(recipe="current")).scaling == "current"
    assert fp8_recipe(FP8Spec(recipe="rowwise")).granularity == "row"


def test_fp8_on_cpu_raises_naming_the_flag_smooth_alone_passes():
    with pytest.raises(ValueError, match=r"--agoq-fp8 current .*needs an NVIDIA GPU.*on the cpu"):
        check_compute(FP8Spec(recipe="current"), torch.device("cpu"), **DIMS)
    check_compute(FP8Spec(smooth_swiglu="per-channel"), torch.device("cpu"), **DIMS)  # runs anywhere


def test_te_is_no_recipe_of_agoqs_linears():
    """``te`` was offered by --agoq-fp8 and always refused at start-up (no agoq TE linear was ever built): the spec
    refuses it by name now, with the recipes it takes (the flag's choices come from the same Literal)."""
    with pytest.raises(ValueError, match=r"fp8 recipe 'te': use one of \['off', 'current', 'delayed', 'rowwise'\]"):
        FP8Spec(recipe="te")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen capability, for the checks only (nothing runs on it)."""
    caps = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    return caps


def test_old_gpu_raises(fake_gpu):
    fake_gpu["value"] = (8, 0)
    with pytest.raises(ValueError, match=r"compute capability >= \(8, 9\).*\(8, 0\)"):
        check_compute(FP8Spec(recipe="delayed"), torch.device("cuda"), **DIMS)


def test_dims_not_multiple_of_16_and_no_fp8_layer_raise(fake_gpu):
    check_compute(FP8Spec(recipe="delayed"), torch.device("cuda"), **DIMS)  # fine
    with pytest.raises(ValueError, match="tokens per micro-batch"):
        check_compute(FP8Spec(recipe="delayed"), torch.device("cuda"), **{**DIMS, "tokens_per_microbatch": 100})
    with pytest.raises(ValueError, match="ffn-hidden-size / TP"):
        check_compute(FP8Spec(recipe="delayed"), torch.device("cuda"), **{**DIMS, "ffn": 200})
    with pytest.raises(ValueError, match="no layer runs in FP8"):
        check_compute(FP8Spec(recipe="delayed", bf16_first_layers=2, bf16_last_layers=2), torch.device("cuda"), **DIMS)


def test_report_lines():
    assert compute_report(FP8Spec(), 4) == "fp8: off (bf16 linears) | smooth-swiglu: off"
    text = compute_report(FP8Spec(recipe="delayed", smooth_swiglu="per-token", bf16_last_layers=2), 6)
    assert text == ("fp8: per-tensor delayed scaling (amax history 16), E4M3 forward / E5M2 backward, layers 1-3; "
                    "bf16: layers 0, 4-5 and the LM head | smooth-swiglu: per-token | swiglu + fc2 cast: fused")
    plain = FP8Spec(recipe="delayed")
    assert compute_report(plain, 6).endswith("| smooth-swiglu: off | swiglu + fc2 cast: fused")
    assert compute_report(plain, 6, plain_swiglu_fusion=False).endswith(
        "| swiglu + fc2 cast: unfused (AGOQ_FP8_SWIGLU_FUSION=0)")
    assert compute_report(FP8Spec(recipe="current"), 6).endswith("| smooth-swiglu: off")  # never fused
