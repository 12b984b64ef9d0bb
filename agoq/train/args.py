"""Command line of ``scripts/pretrain_llama.py``: Megatron-compatible flags, ``--agoq-*`` flags, config files.

Precedence (lowest to highest): built-in defaults < ``--config FILE.yaml`` < ``--agoq-preset NAME_OR_FILE`` (agoq's
settings only; a key in both files is an error) < flags on the command line.
:func:`parse_args` also builds the run's ``agoq.config.AgoqConfig`` from the merged values, once, and keeps it
as ``args.agoq_config``: the trainer passes it (or a section) to library code, which never reads this
Namespace. Megatron's own flags (layout, batch sizes, lr) stay on the Namespace for the trainer.
A config file holds flag names in snake_case (``num_layers: 4``); an unknown key stops the run with
the file, the key and the allowed keys. Unknown or abbreviated flags are errors too
(``allow_abbrev=False``), so a typo never silently falls back to a default.

The command line's parts, by concern: the parser and its flags (:mod:`agoq.cli.flags`, with
``optim_args``, ``graph_args`` and ``flag_hints`` for unknown flags; below the trainer, so python -m agoq.plan takes
the same flags), config files (:mod:`agoq.cli.config_file`), checks of the parsed values
(:mod:`agoq.train.checks`) and the checks against the world size and data files
(:mod:`agoq.train.preflight`). This module puts them together (:func:`parse_args`, :func:`build_config`,
:func:`parse_and_check`) and re-exports the names the script, the trainer and the tests import from it.
"""

from __future__ import annotations

import argparse
import os
import sys

from agoq.cli.agoq_flags import merge_preset
from agoq.cli.config_file import load_config_file
from agoq.cli.flag_hints import MEGATRON_LM_ONLY
from agoq.cli.flags import (
    DEFAULT_POLICY,
    build_parser,
    exit_quietly_after_delay,
    policy_path,
)
from agoq.cli.seqpar_args import check_sequence_parallel_args

# Light imports only (argparse, yaml, numpy, sentencepiece, the torch-free policy and format packages): the
# script parses and checks its command line before torch and megatron load (~5 s), so a bad flag, policy or
# data file stops in about a second (tests/unit/test_args.py::test_parsing_imports_neither_torch_nor_megatron).
from agoq.config import AgoqConfig
from agoq.config.values import (
    DEFAULT_MASTER,
    DEFAULT_MOMENTS,
    FLOAT_GRADS,
    GRAD_MODES,
    GradsFormatError,
    torch_optimizer_state_refusal,
)
from agoq.policy import load_policy
from agoq.train import determinism
from agoq.train.checks import (
    check_fc2_amax_flag,
    check_policy_rules,
    check_unused_flags,
    data_blend,
    given_on_command_line,
    unused_file_settings,
    validate,
)
from agoq.train.preflight import check_layout, microbatch_count, preflight

# what the script, the trainer, agoq.plan and the tests import from here
__all__ = [
    "DEFAULT_POLICY", "FLOAT_GRADS", "GRAD_MODES", "MEGATRON_LM_ONLY", "build_config", "build_parser", "check_layout",
    "check_policy_rules", "check_unused_flags", "data_blend", "given_on_command_line", "load_config_file",
    "microbatch_count", "parse_and_check", "parse_args", "policy_path", "preflight", "validate",
]


def parse_args(argv: list[str] | None = None, *, quiet: bool = False,
               environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse and check the command line and build ``args.agoq_config`` (:func:`build_config`; ``environ``:
    the process environment, ``os.environ`` when None); on an error print one line (none with ``quiet``)
    and exit 2."""
    parser = build_parser()
    parser.quiet = quiet
    first = parser.parse_args(argv)
    file_keys: set[str] = set()
    if first.config or first.agoq_preset:
        try:
            values = load_config_file(first.config, parser) if first.config else {}
            if first.agoq_preset:
                values = merge_preset(values, first.agoq_preset, first.config)
        except ValueError as exc:
            parser.error(str(exc))
        parser.set_defaults(**values)
        file_keys = set(values)
    args = parser.parse_args(argv)
    try:
        _check_optimizer_state_flags(args)
        _fill_derived(args)
        validate(args)
        args.agoq_config = build_config(args, os.environ if environ is None else environ)
        check_policy_rules(args, args.agoq_config.policy.spec)
        check_sequence_parallel_args(args, args.agoq_config.fp8)
        check_fc2_amax_flag(args)
        command_line = given_on_command_line(argv)
        check_unused_flags(args, command_line | file_keys, command_line)
        args.config_file_unused = unused_file_settings(args, file_keys, command_line)  # said at start-up
    except ValueError as exc:
        parser.error(str(exc))
    return args


def build_config(args: argparse.Namespace, environ) -> AgoqConfig:
    """The run's AgoqConfig from the parsed flags (config file < command line), the policy file loaded once,
    and the environment variables agoq's library would otherwise read (TRITON_INTERPRET; the kernels section's,
    agoq.train.environment.kernels_from_environment). The planner
    and the memory report build theirs with the same ``AgoqConfig.from_flags``."""
    from agoq.train.environment import kernels_from_environment

    policy = None if args.agoq_disable else load_policy(policy_path(args))
    try:
        return AgoqConfig.from_flags(vars(args), policy=policy,
                                     triton_interpret=environ.get("TRITON_INTERPRET") == "1",
                                     kernels=kernels_from_environment(environ))
    except GradsFormatError as exc:  # the float names this trainer takes (_check_float_grads_name)
        floats = "fp32, or bf16 with --grad-reduce-in-bf16 (Megatron's float gradients)"
        raise ValueError(exc.allowing(floats)) from None


def _check_optimizer_state_flags(args: argparse.Namespace) -> None:
    if args.agoq_optimizer == "torch":
        for flag in ("agoq_moments", "agoq_master"):
            if getattr(args, flag) is not None:
                raise ValueError(torch_optimizer_state_refusal(f"--{flag.replace('_', '-')}", getattr(args, flag)))
    if args.agoq_moments is None:
        args.agoq_moments = DEFAULT_MOMENTS
    if args.agoq_master is None:
        args.agoq_master = DEFAULT_MASTER


def _fill_derived(args: argparse.Namespace) -> None:
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 64 * -(-int(8 * args.hidden_size / 3) // 64)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.vpp = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.vpp = per_stage // args.num_layers_per_virtual_pipeline_stage


def parse_and_check(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's start: :func:`parse_args` and :func:`preflight` against torchrun's WORLD_SIZE. A mistake
    is printed in one line by the first process of each node (LOCAL_RANK 0; the same line from every rank
    would repeat it per process) and every process exits 2."""
    quiet = os.environ.get("LOCAL_RANK", "0") != "0"
    args = parse_args(argv, quiet=quiet)
    try:
        preflight(args, int(os.environ.get("WORLD_SIZE", "1")))
        if args.deterministic_mode:  # before torch loads: NCCL and cuBLAS read these once
            determinism.apply_environment(os.environ)
    except ValueError as exc:
        if quiet:
            exit_quietly_after_delay()
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args
