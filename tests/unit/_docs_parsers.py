"""The docs check runs a documented script or module in this process until its argparse parser has parsed (nothing
trains, downloads or writes): whether it accepts a command line, the flags it has, and scripts/pretrain_llama.py's
full start-up check. Used by tests/unit/_docs_checks.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import sys
from pathlib import Path

from agoq.testing.procs import REPO_ROOT
from tests.unit._docs_commands import PRETRAIN


class _Parsed(Exception):  # noqa: N818 (a stop signal, not an error)
    pass


@contextlib.contextmanager
def _process_state():
    """A script run in this process may set os.environ, sys.path or sys.argv: put them back."""
    environ, path, argv = dict(os.environ), list(sys.path), list(sys.argv)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        sys.argv[:] = argv


def parse_script_args(target: str, args: list[str], *, module: bool = False) -> str | None:
    """Run ``target`` (a script path or a module) in this process until its argparse parser has parsed
    ``args``; None when it accepts them, else its error text."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err = io.StringIO()
    with _process_state(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        argparse.ArgumentParser.parse_args = parse_then_stop
        sys.argv[:] = [target, *args]
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO_ROOT / target), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as exc:
            if exc.code in (0, None):
                return None  # --help
            return f"exit {exc.code}: {err.getvalue().strip()[-600:]}"
        finally:
            argparse.ArgumentParser.parse_args = original
    return f"{target} finished without parsing a command line (no rule for it)"


def check_pretrain(args: list[str], world_size: int, stand_in: Path) -> str | None:
    """scripts/pretrain_llama.py's start-up checks on ``args`` (without reading your data files)."""
    from agoq.train.args import check_layout, parse_args

    args = list(args)
    for i, word in enumerate(args[:-1]):
        if word == "--tokenizer-model" and not (REPO_ROOT / args[i + 1]).is_file():
            args[i + 1] = str(stand_in)  # yours to provide
    err = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(REPO_ROOT)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parse_args(args, quiet=False)
        check_layout(ns, world_size)
        from agoq.megatron.model import ParallelLayout
        from agoq.train.pretrain import num_microbatches

        layout = ParallelLayout(tp=ns.tensor_model_parallel_size, pp=ns.pipeline_model_parallel_size, vpp=ns.vpp)
        num_microbatches(ns, layout, world_size)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip()
    except ValueError as exc:
        return str(exc)
    finally:
        os.chdir(cwd)
    return None


def run_in_process(script: str) -> str | None:
    err = io.StringIO()
    with _process_state(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        sys.argv[:] = [script]
        try:
            runpy.run_path(str(REPO_ROOT / script), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                return f"exit {exc.code}: {err.getvalue().strip()[-600:]}"
    return None



def parser_options(target: str, *, module: bool = False) -> dict[str, argparse.Action] | None:
    """The options (option string -> action) of the parser ``target`` builds (run in this process until it
    parses)."""
    if target == PRETRAIN:
        from agoq.train.args import build_parser

        return dict(build_parser()._option_string_actions)
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    with _process_state(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        argparse.ArgumentParser.parse_args = capture
        sys.argv[:] = [target]
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO_ROOT / target), run_name="__main__")
        except _Parsed as parsed:
            return dict(parsed.args[0]._option_string_actions)
        except SystemExit:
            return None
        finally:
            argparse.ArgumentParser.parse_args = original
    return None
