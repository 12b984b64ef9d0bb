"""Bad input to pretrain_llama.py stops before any work, with one message naming the flag/file and fix."""

from __future__ import annotations

import pytest

from agoq.testing.procs import TINY_CONFIG
from agoq.train.args import parse_args


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_config_file_then_command_line_precedence(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("num_layers: 6\nhidden_size: 96\nnum_attention_heads: 6\nlr: 0.5\n")
    args = parse_args(["--config", str(cfg), "--lr", "0.25"])
    assert (args.num_layers, args.hidden_size, args.lr) == (6, 96, 0.25)  # CLI beats file beats default
    assert args.num_query_groups == 6  # derived: MHA when not given
    assert args.ffn_hidden_size == 256  # 8/3 * 96 = 256, already a multiple of 64


def test_tiny_config_loads():
    args = parse_args(["--config", str(TINY_CONFIG)])
    assert args.num_layers == 4 and args.num_query_groups == 2


def test_unknown_config_key_names_file_key_and_suggestion(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("num_layer: 4\n")
    err = _error(capsys, ["--config", str(cfg)])
    assert str(cfg) in err and "num_layer" in err and "did you mean 'num_layers'" in err


def test_yaml_syntax_error_names_file(tmp_path, capsys):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("num_layers: [4\n")
    err = _error(capsys, ["--config", str(cfg)])
    assert str(cfg) in err and "YAML syntax error" in err


@pytest.mark.parametrize("flag", ["--config", "--agoq-policy", "--tokenizer-model"])
def test_missing_file_names_the_flag(flag, capsys):
    err = _error(capsys, [flag, "/no/such/file.yaml"])
    assert f"{flag} /no/such/file.yaml" in err and "not found" in err


def test_unknown_and_abbreviated_flags_are_errors(capsys):
    assert "unrecognized arguments: --num-layer" in _error(capsys, ["--num-layer", "4"])
    assert "unrecognized arguments: --num-lay" in _error(capsys, ["--num-lay", "4"])


def test_virtual_pipeline_that_does_not_divide(capsys):
    err = _error(capsys, ["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "2"])
    assert "--num-layers-per-virtual-pipeline-stage 2" in err


def test_warmup_longer_than_decay(capsys):
    err = _error(capsys, ["--train-iters", "3", "--lr-warmup-iters", "5"])
    assert "--lr-warmup-iters 5" in err and "--lr-decay-iters 3" in err


def test_data_path_needs_tokenizer(capsys):
    assert "--tokenizer-model" in _error(capsys, ["--data-path", "data/x"])


def test_recompute_flags(capsys):
    args = parse_args(["--recompute-granularity", "full", "--agoq-disable", "--recompute-num-layers", "2"])
    assert (args.recompute_granularity, args.recompute_num_layers) == ("full", 2)
    assert "--recompute-num-layers must be >= 1" in _error(capsys, ["--agoq-disable", "--recompute-granularity",
                                                                   "full", "--recompute-num-layers", "0"])
    selective = parse_args(["--recompute-granularity", "selective", "--agoq-disable"])
    assert selective.agoq_config.activations.selective_recompute and not selective.agoq_config.activations.recompute
    assert "selective recompute takes no layer count" in _error(capsys, ["--recompute-granularity", "selective",
                                                                        "--recompute-num-layers", "2"])
    assert "invalid choice: 'block'" in _error(capsys, ["--recompute-granularity", "block"])


def test_grad_reduce_in_bf16_sets_megatron_ddp_and_refuses_unvalidated_combos(capsys):
    from agoq.train.megatron_setup import ddp_config

    args = parse_args(["--grad-reduce-in-bf16"])
    import torch

    assert ddp_config(args, torch.bfloat16).grad_reduce_in_fp32 is False
    assert ddp_config(parse_args([]), torch.bfloat16).grad_reduce_in_fp32 is True  # Megatron's bf16 default
    assert "needs bf16 parameters" in _error(capsys, ["--grad-reduce-in-bf16", "--fp32"])
    err = _error(capsys, ["--grad-reduce-in-bf16", "--agoq-grads", "int8_b256"])
    assert "--grad-reduce-in-bf16 with --agoq-grads int8_b256" in err


def test_overlap_param_gather_needs_the_distributed_optimizer_and_reaches_megatrons_ddp(capsys):
    """Megatron-LM's two requirements (megatron/training/arguments.py), refused by name before any work; the
    accepted flag sets DistributedDataParallelConfig.overlap_param_gather, and align_param_gather (Megatron-LM's
    default) only with an interleaved pipeline."""
    import torch

    from agoq.train.megatron_setup import ddp_config

    err = _error(capsys, ["--overlap-param-gather", "--overlap-grad-reduce"])
    assert "--overlap-param-gather" in err and "needs --use-distributed-optimizer" in err
    err = _error(capsys, ["--overlap-param-gather", "--use-distributed-optimizer"])
    assert "--overlap-param-gather needs --overlap-grad-reduce" in err
    flags = ["--overlap-param-gather", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    plain = ddp_config(parse_args(flags), torch.bfloat16)
    assert (plain.overlap_param_gather, plain.align_param_gather) == (True, False)
    vpp = ddp_config(parse_args(flags + ["--pipeline-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1"]), torch.bfloat16)
    assert (vpp.overlap_param_gather, vpp.align_param_gather) == (True, True)
    off = ddp_config(parse_args(flags[1:]), torch.bfloat16)
    assert (off.overlap_param_gather, off.align_param_gather) == (False, False)


# --------------------------------------------------------------------------------------- issue 21 ----
def test_parsing_imports_neither_torch_nor_megatron():
    """The script checks its command line before torch and megatron load (~5 s): argument errors are fast."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "from agoq.train.args import parse_args; parse_args(['--agoq-optimizer', 'adamw'])")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_light_copies_of_choices_agree_with_their_sources():
    from agoq.config import values
    from agoq.megatron.grads import ddp
    from agoq.optim.base import MASTER_CHOICES
    from agoq.train import args as margs

    assert values.MASTER_CHOICES == MASTER_CHOICES and margs.GRAD_MODES == ddp.GRAD_MODES


def test_an_error_is_one_line_without_the_usage_dump(capsys):
    err = _error(capsys, ["--num-layers", "0"])
    assert err == ("pretrain_llama.py: error: --num-layers must be positive, got 0 "
                   "(all flags: pretrain_llama.py --help)\n")
    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "0"], quiet=True)  # ranks after the first print nothing
    assert capsys.readouterr().err == ""


def test_quiet_ranks_exit_after_the_printing_rank(monkeypatch, capsys):
    """torchrun stops all workers when the first exits: a quiet rank waits QUIET_EXIT_DELAY_S so the printing
    rank's error line is out first (both for parser errors and for preflight's)."""
    import time

    from agoq.cli import flags
    from agoq.train import args as margs

    monkeypatch.setattr(flags, "QUIET_EXIT_DELAY_S", 0.2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for argv in (["--num-layers", "0"], ["--pipeline-model-parallel-size", "3"]):
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as exc:
            margs.parse_and_check(argv)
        assert exc.value.code == 2 and time.monotonic() - t0 >= 0.2, argv
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--agoq-moments", "fp8"], "--agoq-moments fp8 sets a state format of agoq's optimizer, but --agoq-optimizer "
                                    "is torch"),
        (["--agoq-master", "fp32"], "--agoq-master fp32 sets a state format"),
        (["--save-interval", "-1"], "--save-interval must be a positive number of iterations (0 or left out: save "
                                    "at the end only), got -1"),  # it used to save at every iteration
        (["--exit-interval", "-3"], "--exit-interval must be a positive number of iterations (0 or left out: run "
                                    "to --train-iters), got -3"),
        (["--manual-gc-interval", "5"], "--manual-gc-interval acts only with --manual-gc"),
        (["--no-manual-gc-eval"], "--no-manual-gc-eval acts only with --manual-gc"),
        (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be 0 (no collection between "
                                                        "steps) or a positive number of steps, got -1"),
        (["--num-layers-per-virtual-pipeline-stage", "1"],
         "--num-layers-per-virtual-pipeline-stage 1 (the interleaved schedule) needs "
         "--pipeline-model-parallel-size >= 2"),
        (["--agoq-grads", "int7_b256"], "--agoq-grads int7_b256: unknown format name 'int7_b256'"),
        (["--agoq-grads", "cuint8_b32"], "--agoq-grads cuint8_b32: unsigned; allowed: a signed quantized format"),
        (["--agoq-grads", "int8_b256_sr"], "--agoq-grads int8_b256_sr: stochastic rounding; allowed:"),
        (["--split", "a,b"], "--split 'a,b': expected up to three non-negative weights"),
        (["--data-path", "0.3", "a", "0.7", "--tokenizer-model", __file__],
         "a weighted blend is 'W1 PREFIX1 W2 PREFIX2"),
    ],
)
def test_silently_accepted_flags_are_refused(argv, expected, capsys):
    assert expected in _error(capsys, argv)


def test_grads_error_names_the_allowed_values(capsys):
    err = _error(capsys, ["--agoq-grads", "int7_b256"])
    assert "Allowed: a signed quantized format with round-to-nearest, e.g. int8_b256" in err
    # the float names this trainer takes (fp16 is refused: tests/unit/test_args_mistakes.py); it listed fp16
    assert "or fp32, or bf16 with --grad-reduce-in-bf16 (Megatron's float gradients)" in err
    assert "fp16" not in err.split("Allowed:")[1]


def test_grads_error_on_the_megatron_lm_path_keeps_every_float_name():
    """Under megatron.training (agoq.train.megatron_lm) the config layer's message lists FLOAT_GRADS."""
    from agoq.config import AgoqConfig

    with pytest.raises(ValueError, match=r"or fp32, bf16, fp16 \(Megatron's float gradients\)"):
        AgoqConfig.from_flags({"agoq_grads": "int7_b256"})


def test_state_flags_with_agoq_optimizer_and_defaults():
    args = parse_args(["--agoq-optimizer", "adamw", "--agoq-moments", "fp8"])
    assert (args.agoq_moments, args.agoq_master) == ("fp8", "split24")
    assert (parse_args([]).agoq_moments, parse_args([]).agoq_master) == ("flash", "split24")


def test_weighted_data_path_is_megatrons_blend():
    from agoq.train.args import data_blend

    assert data_blend(["0.3", "data/a", "0.7", "data/b"]) == [(0.3, "data/a"), (0.7, "data/b")]
    assert data_blend(["data/a", "data/b"]) == ["data/a", "data/b"]


def test_first_run_load_directory_may_not_exist_yet(tmp_path, capsys):
    """--save ckpt --load ckpt on a fresh machine starts from scratch (pretrain says so), as Megatron-LM does."""
    assert parse_args(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt")]).load
    (tmp_path / "file").write_text("x")
    assert f"--load {tmp_path / 'file'}: not a directory" in _error(capsys, ["--load", str(tmp_path / "file")])


def _policy(tmp_path, rules: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ndefault: {activations: int8_b128}\nrules:\n" + rules)
    return str(path)


@pytest.mark.parametrize(
    "rules,layout,dead",
    [
        ("  - {when: {layers: '10-12'}, set: {activations: bf16}}\n", [], r"rules\[0\] decide no site"),
        ("  - {when: {pp_stage: 5}, set: {activations: bf16}}\n", ["--pipeline-model-parallel-size", "2"],
         r"rules\[0\] decide no site of this model \(layers 0..3, pp_size=2, vp_size=None\)"),
        ("  - {when: {layers: '0-1'}, set: {activations: bf16}}\n"
         "  - {when: {layers: '2-3'}, set: {activations: int4_b64}}\n"
         "  - {when: {role: norm.input}, set: {activations: nf4_b64}}\n", [], r"rules\[2\] decide no site"),
    ],
    ids=["layers-beyond-model", "stage-beyond-pipeline", "shadowed-by-two-rules"],
)
def test_policy_rules_that_decide_no_site_are_errors(tmp_path, capsys, rules, layout, dead):
    """docs/policy.md section 8: reported at start-up (before torch loads), naming file, rules and layout."""
    import re

    err = _error(capsys, ["--agoq-policy", _policy(tmp_path, rules), *layout])
    assert re.search(r"p\.yaml: " + dead, err), err
    assert "fix or delete them" in err


def test_a_rule_naming_layers_beyond_the_model_is_an_error_even_when_some_exist(tmp_path, capsys):
    """'0-9' on the 4-layer model would act on layers 0..3 only, without a word: name the missing ones."""
    def rule(layers: str) -> str:
        return _policy(tmp_path, f"  - {{when: {{layers: {layers}}}, set: {{activations: bf16}}}}\n")

    err = _error(capsys, ["--agoq-policy", rule("'0-9'")])
    assert "p.yaml: rules[0].when.layers names layers this model does not have (4-9)" in err, err
    assert "the model's layers are 0..3" in err
    assert "(5-6, 8)" in _error(capsys, ["--agoq-policy", rule("[1, 5, 6, 8]")])
    assert parse_args(["--agoq-policy", rule("'0-3'")])


def test_preflight_checks_layout_and_data_before_torch(tmp_path):
    from agoq.data.tokenizer import TokenizerTrainConfig, train_sentencepiece
    from agoq.testing.indexed import write_indexed_dataset as write_dataset
    from agoq.train.args import preflight

    with pytest.raises(ValueError, match=r"world size 2 is not divisible by --tensor-model-parallel-size 1 x "
                                         r"--pipeline-model-parallel-size 4; launch a multiple of 4 processes"):
        preflight(parse_args(["--pipeline-model-parallel-size", "4"]), world_size=2)  # was ZeroDivisionError
    text = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(200)]
    model = train_sentencepiece(text, tmp_path / "tok.model", TokenizerTrainConfig(vocab_size=360))
    prefix = write_dataset(tmp_path / "d", [[i % 299 + 1] * 40 for i in range(400)])
    base = ["--data-path", prefix, "--tokenizer-model", str(model), "--seq-length", "32"]
    with pytest.raises(ValueError, match=r"--split 969,30,1: the test split of .*d is empty \(documents 400..400"):
        preflight(parse_args(base), world_size=1)
    preflight(parse_args([*base, "--split", "90,5,5"]), world_size=1)
    big = write_dataset(tmp_path / "big", [[1000] * 40 for _ in range(400)])
    with pytest.raises(ValueError, match=r"big.bin: token id 1000 is outside the vocabulary of .*tok\.model \(360"):
        preflight(parse_args([*base, "--split", "90,5,5", "--data-path", big]), world_size=1)
    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.model is empty"):
        preflight(parse_args([*base, "--split", "90,5,5", "--tokenizer-model", str(tmp_path / "empty.model")]), 1)


def test_lr_below_min_lr_is_an_argument_error_not_a_megatron_assert(capsys):
    err = _error(capsys, ["--lr", "1e-4"])
    assert "--lr 0.0001 must be at least --min-lr 0.0003" in err and "--min-lr 1e-05" in err


def test_log_fc2_amax_needs_fp8_delayed(capsys):
    """--log-fc2-amax (issue 27's outlier proxy) reads the FP8 fc2's delayed-scaling history: refused by name
    without --agoq-fp8 delayed, accepted with it."""
    err = _error(capsys, ["--log-fc2-amax"])
    assert "--log-fc2-amax" in err and "--agoq-fp8 delayed" in err
    err = _error(capsys, ["--log-fc2-amax", "--agoq-fp8", "current"])
    assert "this run: current" in err
    args = parse_args(["--log-fc2-amax", "--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-token"])
    assert args.log_fc2_amax and not parse_args([]).log_fc2_amax


def test_manual_gc_flags_as_megatron_lm_and_from_a_config_file(tmp_path, capsys):
    args = parse_args(["--manual-gc", "--manual-gc-interval", "10", "--no-manual-gc-eval"])
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (True, 10, False)
    assert parse_args([]).manual_gc_eval is True  # collections around evaluations by default (Megatron-LM)
    cfg = tmp_path / "gc.yaml"
    cfg.write_text("manual_gc: true\nmanual_gc_eval: false\n")  # a store_false switch by its snake_case name
    args = parse_args(["--config", str(cfg)])
    assert (args.manual_gc, args.manual_gc_eval) == (True, False)
    cfg.write_text("manual_gc_eval: 'no'\n")
    assert "manual_gc_eval (--no-manual-gc-eval) is a switch" in _error(capsys, ["--config", str(cfg)])


def test_the_config_files_unused_settings_are_named_for_the_start_up_line():
    """A model config's Adam betas under --agoq-optimizer lion / sgd, and its save interval without --save, stay in
    the file for the runs that use them: not an error, but said (the trainer prints args.config_file_unused)."""
    from agoq.testing.procs import REPO_ROOT

    config = ["--config", str(REPO_ROOT / "configs" / "model" / "llama-125m.yaml")]
    assert parse_args(config).config_file_unused == ["save_interval 1000 (checkpoints are saved only with --save DIR)"]
    lion = parse_args([*config, "--agoq-optimizer", "lion", "--save", "/tmp/x"]).config_file_unused
    assert lion == ["adam_beta1, adam_beta2, adam_eps (Adam's; --agoq-optimizer lion takes --agoq-lion-beta1 and "
                    "--agoq-lion-beta2 (and no eps))"]
    assert parse_args([*config, "--agoq-optimizer", "adamw", "--save-interval", "5", "--save", "/tmp/x"]
                      ).config_file_unused == []  # given on the command line: the command line's checks apply


def test_eval_interval_with_an_empty_validation_split_is_refused(capsys):
    """--split giving the valid split weight 0 left evaluation with no batches (a TypeError deep in the schedule)."""
    err = _error(capsys, ["--eval-interval", "2", "--split", "100,0,0"])
    assert "--eval-interval 2 evaluates the validation split, which --split 100,0,0 gives weight 0" in err, err
    assert parse_args(["--eval-interval", "2", "--split", "99,1,0"])  # an empty test split only skips the test


def test_rope_fusion_flag_resolves_per_device_and_reaches_the_planner(capsys):
    """--rope-fusion: auto = agoq's fused RoPE where agoq is on and the run is on CUDA; agoq = always; off = never.
    The planner's recipe follows it (no per-layer cos / sin saves); a wrong value names the allowed ones."""
    from agoq.plan.recipe import recipe_of

    auto = parse_args(["--config", str(TINY_CONFIG)]).agoq_config
    assert auto.rope_fusion == "auto" and auto.rope_fused(on_cuda=True) and not auto.rope_fused(on_cuda=False)
    baseline = parse_args(["--config", str(TINY_CONFIG), "--agoq-disable"]).agoq_config
    assert not baseline.rope_fused(on_cuda=True)
    forced = parse_args(["--config", str(TINY_CONFIG), "--agoq-disable", "--rope-fusion", "agoq"]).agoq_config
    assert forced.rope_fused(on_cuda=True) and forced.rope_fused(on_cuda=False)
    off = parse_args(["--config", str(TINY_CONFIG), "--rope-fusion", "off"]).agoq_config
    assert not off.rope_fused(on_cuda=True)
    assert recipe_of(auto).rope_fused and not recipe_of(auto, on_cuda=False).rope_fused
    assert not recipe_of(off).rope_fused
    assert type(auto).from_dict(forced.as_dict()).rope_fusion == "agoq"
    err = _error(capsys, ["--config", str(TINY_CONFIG), "--rope-fusion", "te"])
    assert "--rope-fusion" in err and "auto" in err and "off" in err
