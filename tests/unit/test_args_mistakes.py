"""A Megatron user's common mistakes with pretrain_llama.py's command line and config files: each stops at parse
time (before torch loads) with one line naming the file or flag, the rule and the allowed values or the fix,
instead of being ignored or failing later (house rule: clear errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agoq.train.args import parse_args


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, expected", [
    ("num_layers: four\n", "num_layers (--num-layers) takes an integer; got 'four'"),  # named no file before
    ("num_layers: 4.5\n", "num_layers (--num-layers) takes an integer; got 4.5"),  # was kept as a float
    ("num_layers: [4]\n", "num_layers (--num-layers) takes one value; got [4]"),  # was a TypeError traceback
    ("lr: fast\n", "lr (--lr) takes a number; got 'fast'"),
    ("fp32: 'no'\n", "fp32 (--fp32) is a switch: write fp32: true or fp32: false"),  # 'no' turned fp32 on
    ("attention_backend: flash\n",  # was refused only after torch, megatron and the data had loaded
     "attention_backend (--attention-backend): invalid choice; got 'flash'; allowed: sdpa, megatron"),
    ("agoq_fp8: off\n", "agoq_fp8 (--agoq-fp8) takes one of the choices; got False (YAML reads unquoted"),
    ("agoq_optimizer: adam\n", "agoq_optimizer (--agoq-optimizer): invalid choice; got 'adam'; allowed: torch, adamw"),
])  # fmt: skip
def test_config_value_of_the_wrong_type_or_choice_names_file_key_and_flag(tmp_path, capsys, text, expected):
    path = _config(tmp_path, text)
    err = _error(capsys, ["--config", path])
    assert f"--config {path}: {expected}" in err, err


def test_config_values_are_typed_as_on_the_command_line(tmp_path):
    path = _config(tmp_path, "lr: 3e-3\nmin_lr: 0\nnum_query_groups: null\nfp32: true\ndata_path: data/x\n"
                             "tokenizer_model: " + __file__ + "\ndebug_nonfinite_at_iteration: 3\n")
    args = parse_args(["--config", path])
    assert (args.lr, args.min_lr, args.num_query_groups, args.fp32) == (3e-3, 0.0, 4, True)
    assert args.data_path == ["data/x"]  # one prefix; it used to become a list of characters
    assert args.debug_nonfinite_at_iteration == [3]
    blend = _config(tmp_path, "data_path: [0.3, data/a, 0.7, data/b]\ntokenizer_model: " + __file__ + "\n")
    assert parse_args(["--config", blend]).data_path == ["0.3", "data/a", "0.7", "data/b"]


@pytest.mark.parametrize("argv, expected", [
    (["--tokenizer-model", __file__],  # the built-in corpus was used with its own tokenizer
     f"--tokenizer-model {__file__} is read only with --data-path"),
    (["--save-interval", "5"], "--save-interval 5 saves checkpoints into --save DIR, which is not given"),
    (["--eval-iters", "5"], "--eval-iters 5 sizes each evaluation, but evaluation runs only with --eval-interval N"),
    (["--recompute-num-layers", "2"],
     "--recompute-num-layers 2 sets the layers per group of --recompute-granularity full, which is not given"),
    (["--agoq-grads-mode", "reduce"], "--agoq-grads-mode reduce applies to agoq's 8-bit gradients, which this run "
                                      "does not use (no --agoq-grads FORMAT, and the policy sets no default grads); "
                                      "add --agoq-grads int8_b256, or drop --agoq-grads-mode"),
    (["--agoq-grads", "fp32", "--agoq-grad-transport", "peer"],
     "--agoq-grad-transport peer applies to agoq's 8-bit gradients, which this run does not use (--agoq-grads fp32)"),
    (["--agoq-disable", "--agoq-grads-mode", "store"], "which this run does not use (--agoq-disable); drop"),
    (["--agoq-optimizer", "adamw", "--agoq-sgd-momentum", "0.5"],
     "--agoq-sgd-momentum applies to --agoq-optimizer sgd (this run: adamw)"),
    (["--agoq-optimizer", "lion", "--agoq-sgd-nesterov"], "--agoq-sgd-nesterov applies to --agoq-optimizer sgd"),
    (["--agoq-lion-beta2", "0.9"], "--agoq-lion-beta2 applies to --agoq-optimizer lion (this run: torch)"),
    # found by the 2026-11-27 review: megatron-core sets bucket_size=None without overlap, graphs' warm-up, a schedule
    # override with nothing to load, the fused step's switches with Megatron's Adam, FP8 sub-settings without FP8
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size 1000 sizes the buckets of --overlap-grad-reduce"),
    (["--cuda-graph-warmup-steps", "7"], "--cuda-graph-warmup-steps 7 warms up Megatron's CUDA graphs"),
    (["--override-opt-param-scheduler"], "--override-opt-param-scheduler replaces the learning-rate schedule"),
    (["--agoq-unfused"], "--agoq-unfused runs agoq's optimizer step in plain PyTorch, but --agoq-optimizer is torch"),
    (["--agoq-small-numel", "10"], "--agoq-small-numel 10 tunes agoq's fused optimizer step, but --agoq-optimizer"),
    (["--agoq-fp8", "current", "--agoq-fp8-amax-history-len", "4"],
     "--agoq-fp8-amax-history-len 4 sizes FP8 delayed scaling's amax history, and this run's FP8 recipe is current"),
    (["--agoq-fp8-amax-history-len", "4"], "this run's FP8 recipe is off; add --agoq-fp8 delayed"),
    (["--agoq-fp8-bf16-first-layers", "2"], "--agoq-fp8-bf16-first-layers 2 keeps the first layers of FP8 linears"),
    (["--agoq-fp8-bf16-last-layers", "3"], "--agoq-fp8-bf16-last-layers 3 keeps the last layers of FP8 linears"),
    (["--fp32", "--agoq-optimizer", "adamw", "--agoq-master", "split32"],
     "--agoq-master split32 splits a 16-bit parameter's fp32 master, but --fp32 parameters are their own master"),
    (["--agoq-optimizer", "sgd", "--agoq-sgd-momentum", "0", "--agoq-sgd-nesterov"],
     "--agoq-sgd-nesterov needs momentum, and --agoq-sgd-momentum is 0"),
    (["--agoq-optimizer", "adamw", "--agoq-moments", "foo,cuint8_b32"],  # stopped only after torch had loaded
     "--agoq-moments 'foo,cuint8_b32': the m format: unknown format name 'foo'"),
    (["--agoq-optimizer", "lion", "--agoq-moments", "cint8_b32,garbage"], "the v format: unknown format name"),
    (["--agoq-optimizer", "adamw", "--agoq-moments", "cint8_b32,cuint8_b32_sr"],
     "the v format 'cuint8_b32_sr' rounds stochastically"),
])  # fmt: skip
def test_a_flag_whose_setting_is_off_is_an_error_not_ignored(capsys, argv, expected):
    """Each of these ran before without a word, the flag doing nothing."""
    assert expected in _error(capsys, argv)


def test_flags_with_the_setting_they_need_are_accepted(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert parse_args(["--save", ckpt, "--save-interval", "5"]).save_interval == 5
    assert parse_args(["--save-interval", "0"]).save_interval == 0  # 0: off, as in Megatron-LM
    assert parse_args(["--eval-interval", "10", "--eval-iters", "5"]).eval_iters == 5
    assert parse_args(["--recompute-granularity", "full", "--recompute-num-layers", "2"]).recompute_num_layers == 2
    assert parse_args(["--agoq-grads", "int8_b256", "--agoq-grads-mode", "reduce"]).agoq_grads_mode == "reduce"
    assert parse_args(["--agoq-optimizer", "sgd", "--agoq-sgd-momentum", "0.5"]).agoq_sgd_momentum == 0.5
    assert parse_args(["--overlap-grad-reduce", "--ddp-bucket-size", "1000"]).ddp_bucket_size == 1000
    assert parse_args(["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2"]).cuda_graph_warmup_steps == 2
    assert parse_args(["--load", ckpt, "--override-opt-param-scheduler"]).override_opt_param_scheduler
    assert parse_args(["--agoq-optimizer", "adamw", "--agoq-unfused", "--agoq-small-numel", "10"]).agoq_unfused
    fp8 = parse_args(["--agoq-fp8", "delayed", "--agoq-fp8-amax-history-len", "4", "--agoq-fp8-bf16-first-layers",
                      "0", "--agoq-fp8-bf16-last-layers", "2"]).agoq_config.fp8
    assert (fp8.amax_history_len, fp8.bf16_first_layers, fp8.bf16_last_layers) == (4, 0, 2)
    assert parse_args(["--agoq-fp8", "current", "--agoq-fp8-bf16-first-layers", "2"]).agoq_config.fp8.recipe
    assert parse_args(["--fp32", "--agoq-optimizer", "adamw", "--agoq-master", "none"]).agoq_master == "none"
    # a model config's save_interval is a default for runs that pass --save: without --save it is not an error
    assert parse_args(["--config", _config(tmp_path, "save_interval: 500\n")]).save_interval == 500
    # (the shipped configs set it: tests/unit/test_model_configs.py parses every one without --save)


def test_a_config_key_counts_as_given(tmp_path, capsys):
    err = _error(capsys, ["--config", _config(tmp_path, "eval_iters: 3\n")])
    assert "--eval-iters 3 sizes each evaluation" in err


@pytest.mark.parametrize("argv, expected", [
    (["--agoq-optimizer", "lion", "--adam-beta1", "0.8"],  # Lion's own betas ran; --adam-beta1 did nothing
     "--adam-beta1 0.8 sets Adam (--agoq-optimizer torch or adamw), which --agoq-optimizer lion does not use; "
     "lion takes --agoq-lion-beta1 and --agoq-lion-beta2 (and no eps); drop --adam-beta1"),
    (["--agoq-optimizer", "sgd", "--adam-beta2", "0.99", "--adam-eps", "1e-6"],
     "--adam-beta2 0.99, --adam-eps 1e-06 set Adam (--agoq-optimizer torch or adamw), which --agoq-optimizer sgd "
     "does not use; sgd takes --agoq-sgd-momentum and --agoq-sgd-nesterov; drop --adam-beta2, --adam-eps"),
])  # fmt: skip
def test_adam_flags_with_lion_or_sgd_are_an_error_not_ignored(capsys, argv, expected):
    assert expected in _error(capsys, argv)


def test_adam_flags_with_lion_or_sgd_in_one_config_file_are_an_error(tmp_path, capsys):
    path = _config(tmp_path, "agoq_optimizer: lion\nadam_eps: 1.0e-5\n")
    assert "--adam-eps 1e-05 sets Adam (--agoq-optimizer torch or adamw), which --agoq-optimizer lion does not use" in (
        _error(capsys, ["--config", path]))


def test_adam_defaults_and_a_model_configs_adam_settings_are_accepted_with_lion_or_sgd(tmp_path):
    assert parse_args(["--agoq-optimizer", "lion"]).adam_beta1 == 0.9  # the defaults, not given
    assert parse_args(["--agoq-optimizer", "adamw", "--adam-beta1", "0.8"]).adam_beta1 == 0.8
    assert parse_args(["--adam-eps", "1e-6"]).adam_eps == 1e-6  # torch: Megatron's Adam
    # the shipped model configs set Adam's settings for Adam runs (as save_interval for runs that save): choosing
    # lion or sgd on the command line over such a config is not an error
    path = _config(tmp_path, "adam_beta1: 0.9\nadam_beta2: 0.95\nadam_eps: 1.0e-8\n")
    assert parse_args(["--config", path, "--agoq-optimizer", "sgd"]).agoq_optimizer == "sgd"
    shipped = str(Path(__file__).resolve().parents[2] / "configs" / "model" / "llama-125m.yaml")
    assert parse_args(["--config", shipped, "--agoq-optimizer", "lion"]).adam_beta2 == 0.95


@pytest.mark.parametrize("argv, expected", [
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "0"],  # was: no interleaving
     "--num-layers-per-virtual-pipeline-stage must be positive, got 0; leave it out for the plain 1F1B schedule"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "12", "--num-layers-per-virtual-pipeline-stage", "4"],
     "at least two virtual stages (--num-layers 12); allowed here: 1, 2, 3"),
    (["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
     "no value fits this layout: use more layers per stage, or leave the flag out"),
])  # fmt: skip
def test_virtual_pipeline_errors_name_the_values_that_fit(capsys, argv, expected):
    assert expected in _error(capsys, argv)


def test_batch_sizes_against_the_processes_are_checked_before_torch_with_the_sizes_that_fit():
    """The script's preflight (before torch and megatron load; it used to be found after both had loaded)."""
    from agoq.train.args import preflight

    with pytest.raises(ValueError, match=r"--global-batch-size 15 must be a multiple of --micro-batch-size 2 x "
                                         r"data-parallel size 2 \(world size 2 / \(TP 1 x PP 1\)\) = 4; use "
                                         r"--global-batch-size 12 or 16, or another --micro-batch-size"):
        preflight(parse_args(["--global-batch-size", "15"]), world_size=2)
    with pytest.raises(ValueError, match=r"use --global-batch-size 4, or another"):
        preflight(parse_args(["--global-batch-size", "3"]), world_size=2)
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    with pytest.raises(ValueError, match=r"micro-batches \(3\) to be a multiple of --pipeline-model-parallel-size 2; "
                                         r"raise --global-batch-size \(e.g. 8\), or drop"):
        preflight(parse_args([*interleaved, "--global-batch-size", "6"]), world_size=2)
    preflight(parse_args([*interleaved, "--global-batch-size", "8"]), world_size=2)


def test_log_json_path_is_checked_at_parse_time(tmp_path, capsys):
    """It was opened after the model was built: '[Errno 2] No such file or directory', no flag named."""
    missing = tmp_path / "runs" / "log.jsonl"
    assert (f"--log-json {missing}: directory {missing.parent} does not exist; create it first"
            in _error(capsys, ["--log-json", str(missing)]))
    assert f"--log-json {tmp_path}: is a directory" in _error(capsys, ["--log-json", str(tmp_path)])
    assert parse_args(["--log-json", str(tmp_path / "log.jsonl")]).log_json


@pytest.mark.parametrize("argv, expected", [
    (["--agoq-grads", "bf16"],  # ran Megatron's fp32 gradient buffer without a word
     "--agoq-grads bf16 names Megatron's float gradients in bf16, but this run keeps them in fp32: Megatron keeps "
     "fp32 gradients unless --grad-reduce-in-bf16 is given; add --grad-reduce-in-bf16"),
    (["--agoq-grads", "fp16"], "--agoq-grads fp16 names Megatron's float gradients in fp16, but this run keeps them "
                               "in fp32: this trainer keeps fp32 gradients, or bf16 ones with --grad-reduce-in-bf16"),
    (["--agoq-grads", "fp32", "--grad-reduce-in-bf16"], "keeps them in bf16: --grad-reduce-in-bf16 keeps them in "
                                                        "bf16; write bf16, or drop --grad-reduce-in-bf16"),
    (["--agoq-grads", "bf16", "--fp32"], "--fp32 parameters keep fp32 gradients; write fp32"),
])  # fmt: skip
def test_a_float_gradient_name_must_be_the_buffer_the_run_keeps(capsys, argv, expected):
    assert expected in _error(capsys, argv)


def test_float_gradient_names_that_match_the_buffer_are_accepted(tmp_path, capsys):
    assert parse_args(["--agoq-grads", "fp32"]).agoq_config.grads.format_name == "fp32"
    grads = parse_args(["--agoq-grads", "bf16", "--grad-reduce-in-bf16"]).agoq_config.grads
    assert (grads.format_name, grads.reduce_in_bf16, grads.quantized) == ("bf16", True, False)
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\ndefault: {activations: int8_b128, grads: bf16}\n")
    assert f"{policy}: default.grads bf16 names Megatron's float gradients in bf16" in _error(
        capsys, ["--agoq-policy", str(policy)])


@pytest.mark.parametrize("argv, expected", [
    (["--agoq-polcy", "p.yaml"], "unrecognized arguments: --agoq-polcy p.yaml (did you mean --agoq-policy?)"),
    (["--agoq-grad", "int8_b256", "--global-batch", "8"],
     "(did you mean --agoq-grads for --agoq-grad, --global-batch-size for --global-batch?)"),
    (["--num-lay", "4"], "(did you mean --num-layers?)"),  # abbreviations stay errors, with the full name
    (["--bf16", "--swiglu"], "(Megatron-LM flags this LLaMA-only trainer does not take: --bf16: bf16 is the default "
                             "here (--fp32 for fp32); --swiglu: the model is always LLaMA"),
])  # fmt: skip
def test_an_unknown_flag_names_the_closest_real_one_or_what_megatron_lms_flag_means_here(capsys, argv, expected):
    assert expected in _error(capsys, argv)


def test_megatron_lm_only_flags_are_not_flags_here():
    from agoq.train.args import MEGATRON_LM_ONLY, build_parser

    assert not set(MEGATRON_LM_ONLY) & set(build_parser()._option_string_actions)


@pytest.mark.parametrize("fp8, flags, expected", [
    ("{amax_history_len: 64}", [], "fp8.amax_history_len 64 acts only with delayed scaling, and this run's FP8 "
                                   "recipe is off"),
    ("{recipe: current, amax_history_len: 64}", [], "recipe is current"),
    ("{recipe: delayed, amax_history_len: 64}", ["--agoq-fp8", "rowwise"], "recipe is rowwise (the policy's"),
    ("{bf16_first_layers: 0}", [], "fp8.bf16_first_layers 0 acts only with FP8 linears, and this run's FP8 recipe"),
])  # fmt: skip
def test_a_policy_fp8_setting_without_its_recipe_is_an_error(tmp_path, capsys, fp8, flags, expected):
    """2026-11-27 review: the policy's fp8 sub-settings were accepted where the run's recipe never reads them."""
    policy = tmp_path / "p.yaml"
    policy.write_text(f"version: 1\ndefault: {{activations: bf16}}\nrules: []\nfp8: {fp8}\n")
    err = _error(capsys, ["--agoq-policy", str(policy), *flags])
    assert f"{policy}: " in err and expected in err, err


def test_a_policy_fp8_setting_with_its_recipe_is_accepted(tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\ndefault: {activations: bf16}\nrules: []\nfp8: {amax_history_len: 64}\n")
    assert parse_args(["--agoq-policy", str(policy), "--agoq-fp8", "delayed"]).agoq_config.fp8.amax_history_len == 64


def test_fp8_te_is_no_choice_and_says_where_te_fp8_runs(capsys):
    """--agoq-fp8 te was offered in --help and always refused at start-up (no agoq linear runs TE's recipe): it is no
    choice now, and the error says where Transformer Engine's FP8 runs."""
    err = _error(capsys, ["--agoq-fp8", "te"])
    assert "invalid choice: 'te' (choose from 'off', 'current', 'delayed', 'rowwise')" in err
    assert "--transformer-impl transformer_engine --fp8-format hybrid" in err and "docs/megatron_lm.md" in err
