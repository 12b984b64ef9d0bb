"""python -m agoq.plan with the trainer's words (issue 42 item 4): the trainer's flags and --config files, memory
budgets in human units with a stated default, the vocabulary from the config or the tokenizer (never a silent
default), and --gpus N: the fastest predicted layout that fits on N GPUs with the torchrun command that launches
scripts/pretrain_llama.py with it; that command parses and passes the trainer's own checks."""

from __future__ import annotations

import shlex

import pytest

from agoq.plan import __main__ as plan
from agoq.plan import capacity, headroom, speed
from agoq.plan.memory import GIB
from agoq.plan.shape import ModelShape
from agoq.testing.procs import REPO_ROOT
from agoq.train.args import parse_args, preflight

LLAMA3_8B = str(REPO_ROOT / "configs" / "model" / "llama3-8b.yaml")


def _launch_line(out: str) -> list[str]:
    lines = [shlex.split(line) for line in out.splitlines() if "torchrun" in line.split()]
    assert len(lines) == 1, out
    return lines[0]


def _command(out: str) -> list[str]:
    """The launch command from ``torchrun`` on (the environment words before it: _env)."""
    words = _launch_line(out)
    return words[words.index("torchrun"):]


def _env(out: str) -> dict[str, str]:
    words = _launch_line(out)
    return dict(w.split("=", 1) for w in words[:words.index("torchrun")])


def _chosen(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("fastest that fits: "))


def test_the_issues_command_prints_a_launch_command_the_trainer_accepts(capsys, monkeypatch):
    monkeypatch.setattr(plan, "_nvidia_smi_mib", lambda: [])  # no GPU here: the stated 80 GiB
    assert plan.main(["--config", LLAMA3_8B, "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "memory budget: 80.00 GiB per GPU (no GPU visible: the stated default 80 GiB" in out
    assert "vocabulary 128256" in out  # the config's vocab_size, not a 32,000 default
    words = _command(out)
    assert words[:5] == ["torchrun", "--standalone", "--nproc-per-node", "8", "scripts/pretrain_llama.py"]
    args = parse_args(words[5:], quiet=True)  # the trainer's parser and checks, then its world-size preflight
    preflight(args, world_size=8)
    layout = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
              8 // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    assert f"TP={layout[0]} PP={layout[1]} DP={layout[2]}, micro-batch {args.micro_batch_size}," in _chosen(out)
    assert args.config == LLAMA3_8B and args.vocab_size == 128256 and args.seq_length == 8192
    assert (REPO_ROOT / args.agoq_policy).is_file()
    peak = float(out.split("predicted peak ")[1].split()[0])
    assert 0 < peak <= 80


def _fitting(shape, presets, policies, budget, gpus, seq, gbs, divisible_by=128, max_mbs=8):
    """Every fitting layout, by brute force over capacity.candidates (no ordering, no pruning)."""
    for preset in presets:
        mbs = 1
        while mbs <= max_mbs:
            for c in capacity.candidates(shape, preset, gpus, policies, seq=seq, vocab=shape.vocab_size,
                                         divisible_by=divisible_by, base_flags={}, gbs=gbs, mbs=mbs):
                if c.peak <= budget:
                    sized = ModelShape(*[getattr(shape, k) for k in plan.SHAPE_KEYS],
                                       capacity.padded_vocab(shape.vocab_size, c.tp, divisible_by))
                    yield c, speed.step_time(sized, tp=c.tp, pp=c.pp, vpp=None, dp=c.dp, mbs=c.mbs, gbs=c.gbs,
                                             seq=seq, recompute=c.recompute).total
            mbs *= 2


def test_the_choice_is_the_fastest_fitting_layout_by_brute_force(capsys, tmp_path):
    """A tight budget on 4 GPUs, where the fastest layouts do not fit: the printed choice's modelled step is the
    shortest among all fitting layouts (every preset, micro-batch, recompute, policy), found without the search's
    fastest-first pruning."""
    shape = ModelShape(16, 2048, 16, 8, 5632, 32000)
    model = tmp_path / "m.yaml"
    model.write_text("num_layers: 16\nhidden_size: 2048\nnum_attention_heads: 16\nnum_query_groups: 8\n"
                     "ffn_hidden_size: 5632\nseq_length: 4096\nglobal_batch_size: 32\nvocab_size: 32000\n")
    budget = 12 * GIB
    assert plan.main(["--config", str(model), "--gpus", "4", "--memory-budget", "12GiB", "--max-mbs", "8"]) == 0
    out = capsys.readouterr().out
    chosen_s = float(out.split("modelled step ")[1].split()[0])
    policies = {n: plan.load_policy(plan.POLICY_DIR / f"{n}.yaml") for n in plan.DEFAULT_CANDIDATES}
    presets, _ = plan.launch.presets_for({})
    found = list(_fitting(shape, presets, policies, budget, 4, 4096, 32))
    assert found, "the case must have fitting layouts"
    best = min(t for _, t in found)
    assert chosen_s == pytest.approx(best, abs=6e-4)  # printed to the millisecond
    assert any(t > best * 1.01 for _, t in found)  # the choice mattered: slower layouts fit too
    unfit = [c for c in capacity.candidates(shape, presets[0], 4, policies, seq=4096, vocab=32000, divisible_by=128,
                                            base_flags={}, gbs=32, mbs=1) if c.peak > budget]
    assert unfit  # and some layouts do not fit this budget


def test_command_line_settings_are_kept_and_passed_on(capsys):
    argv = ["--config", LLAMA3_8B, "--gpus", "4", "--memory-budget", "80GB", "--seq-length", "4096",
            "--tensor-model-parallel-size", "2", "--lr", "1e-4", "--train-iters", "5000", "--agoq-optimizer", "adamw",
            "--agoq-moments", "4bit", "--recompute-granularity", "selective"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "memory budget: 74.51 GiB per GPU (--memory-budget 80GB)" in out
    words = _command(out)
    args = parse_args(words[5:], quiet=True)
    preflight(args, world_size=4)
    assert args.tensor_model_parallel_size == 2 and args.seq_length == 4096
    assert (args.lr, args.train_iters, args.recompute_granularity) == (1e-4, 5000, "selective")
    assert args.agoq_config.optimizer.kind == "adamw" and args.agoq_moments == "4bit"
    assert "preset the flags' own" in _chosen(out)


def test_nothing_fits_is_exit_3(capsys):
    assert plan.main(["--config", LLAMA3_8B, "--gpus", "1", "--memory-budget", "8GiB"]) == 3
    assert "nothing fits 6.71 GiB (PyTorch's share) per GPU on 1 GPUs" in capsys.readouterr().out


@pytest.mark.parametrize("text, bytes_", [("80GiB", 80 * GIB), ("80GB", 80 * 10**9), ("85017493504", 85017493504)])
def test_memory_budget_in_human_units(text, bytes_):
    assert plan.parse(["--memory-budget", text]).memory_budget_bytes == bytes_


def test_default_budget_is_the_smallest_visible_gpu_else_a_stated_80gib():
    assert plan.default_budget(lambda: [81559, 143771]) == (81559 * 2**20, "the smallest visible GPU's memory "
                                                                           "(81559 MiB, nvidia-smi)")

    def no_smi():
        raise FileNotFoundError("nvidia-smi")

    assert plan.default_budget(no_smi) == (80 * GIB, "no GPU visible: the stated default 80 GiB")


def test_an_unknown_vocabulary_is_an_error_naming_the_flags(tmp_path, capsys):
    model = tmp_path / "m.yaml"
    model.write_text("num_layers: 4\nhidden_size: 256\nnum_attention_heads: 4\n")
    for mode in ([], ["--gpus", "2"], ["--capacity"]):
        assert plan.main(["--config", str(model), "--memory-budget", "80GiB", *mode]) == 2
        err = capsys.readouterr().err
        assert "the vocabulary is unknown: give --vocab-size N" in err and "--tokenizer-model FILE" in err


def test_a_vocab_size_below_the_tokenizers_is_refused(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    import agoq.data.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer.Tokenizer, "load", classmethod(lambda cls, path: SimpleNamespace(vocab_size=5000)))
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--memory-budget", "1GiB",
            "--tokenizer-model", "t.model"]
    assert plan.main([*base, "--vocab-size", "4096"]) == 2
    assert ("--vocab-size 4096 is smaller than --tokenizer-model t.model's 5000 entries"
            in capsys.readouterr().err)
    values = {"tokenizer_model": "t.model", "vocab_size": 8000}
    assert plan.raw_vocab(values) == 8000 and plan.raw_vocab({"tokenizer_model": "t.model"}) == 5000


@pytest.mark.parametrize("old, new", [("--model", "--config"), ("--tp", "--tensor-model-parallel-size"),
                                      ("--mbs", "--micro-batch-size"), ("--distributed-optimizer",
                                                                        "--use-distributed-optimizer")])
def test_the_planners_old_flag_names_say_the_trainers(old, new, capsys):
    assert plan.main([old, "2"]) == 2
    assert f"{old} is now the trainer's {new}" in capsys.readouterr().err


def test_the_trainer_takes_the_same_vocab_size_flag(capsys):
    assert parse_args(["--vocab-size", "128256"]).vocab_size == 128256
    with pytest.raises(SystemExit):
        parse_args(["--vocab-size", "0"])
    assert "--vocab-size must be positive" in capsys.readouterr().err


def test_speed_model_terms():
    """Recompute adds the forward again (full: every layer; selective: core attention), the pipeline bubble is
    (PP-1)/V micro-batch times, TP pays all-reduces that TP=1 does not."""
    shape = ModelShape(8, 1024, 8, 8, 2816, 128)
    kw = dict(tp=1, pp=1, vpp=None, dp=1, mbs=1, gbs=8, seq=1024)
    none, full, sel = (speed.step_time(shape, **kw, recompute=r) for r in (None, "full", "selective"))
    assert none.recompute == 0 and 0 < sel.recompute < full.recompute < none.compute / 3 * 1.0001
    pp2 = speed.step_time(ModelShape(8, 1024, 8, 8, 2816, 128), **{**kw, "pp": 2}, recompute=None)
    assert pp2.bubble == pytest.approx((pp2.compute + pp2.tp_comm) / 8)  # (PP-1) = 1 slot of 8 micro-batches
    assert speed.step_time(shape, **{**kw, "tp": 2}, recompute=None).tp_comm > 0 == none.tp_comm


def test_the_budget_a_prediction_must_fit_is_the_gpu_less_what_cuda_holds_outside_pytorch(capsys):
    request = plan.parse(["--config", LLAMA3_8B, "--memory-budget", "80GiB"])
    outside = round(headroom.OUTSIDE_ALLOCATOR_GIB * GIB)
    assert plan.budget_of(request) == 80 * GIB - outside
    assert ("memory budget: 80.00 GiB per GPU (--memory-budget 80GiB); 78.71 GiB of it for PyTorch's allocator"
            in capsys.readouterr().out)
    with pytest.raises(ValueError, match="leaves nothing for training"):
        plan.budget_of(plan.parse(["--config", LLAMA3_8B, "--memory-budget", "1GiB"]))


def test_a_layout_within_the_allocators_fragmentation_launches_with_expandable_segments(capsys):
    """The same fastest layout, once with room to spare and once within FRAGMENTATION_GIB of the budget: only the
    second command carries PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and says why."""
    argv = ["--config", LLAMA3_8B, "--gpus", "8"]
    assert plan.main([*argv, "--memory-budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    peak_gib = float(out.split("predicted peak ")[1].split()[0])
    chosen = _chosen(out)
    outside = headroom.OUTSIDE_ALLOCATOR_GIB
    budgets = {"roomy": peak_gib + outside + 2 * headroom.FRAGMENTATION_GIB,
               "tight": peak_gib + outside + headroom.FRAGMENTATION_GIB / 2}
    for name, gib in budgets.items():
        assert plan.main([*argv, "--memory-budget", str(round(gib * GIB))]) == 0
        out = capsys.readouterr().out
        assert _chosen(out) == chosen, name  # a smaller budget cannot make a faster layout fit
        tight = name == "tight"
        assert _env(out) == (headroom.EXPANDABLE if tight else {}), name
        assert ("under the allocator's measured fragmentation" in out) is tight
        parse_args(_command(out)[5:], quiet=True)  # the rest is still the trainer's command


@pytest.mark.parametrize("peak_gib, expandable, expected", [
    (70.0, False, None),  # room to spare
    (77.5, True, None),  # close, but launched with expandable segments
    (77.5, False, "under 0.9 GiB to spare; launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
    (78.0, True, "expect out of memory"),  # over the 77.89 GiB PyTorch may hold on a 79.18 GiB GPU
])  # fmt: skip
def test_the_trainers_start_up_note_on_a_predicted_peak(peak_gib, expandable, expected):
    gpu = 85017493504  # an H100 80GB (79.18 GiB)
    note = headroom.headroom_note(peak_gib * GIB, gpu, expandable)
    if expected is None:
        assert note is None
    else:
        assert note.startswith("warning: predicted peak") and expected in note, note
        assert "79.18 GiB less 1.29 GiB outside PyTorch's allocator (77.89 GiB)" in note
