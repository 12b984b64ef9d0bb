"""agoq's reference trainer on megatron-core, a client of the plugin (:mod:`agoq.megatron`).

Everything that belongs to running a job rather than to agoq inside Megatron lives here: the command line
(``args``: ``AgoqConfig`` built once, from ``flags`` with ``optim_args``, ``graph_args`` and ``flag_hints``:
argparse; ``config_file``; ``checks`` and ``preflight``), the training loop
(``pretrain``, ``training``, ``megatron_setup``), the data pipeline (``data``), start-up and per-iteration reports
(``memory_report``, ``flops``, ``tensorboard``, ``known_warnings``). ``scripts/pretrain_llama.py`` calls it.

Layering: agoq.train imports megatron-core only through agoq.megatron's functions (``runtime``,
``training_parts``, ``datasets``, ``optimizer``, ``megatron_training``; tests/unit/test_boundaries.py) and takes the
loop's own parts, the pipeline schedule and the LR schedule, from its entry script
(``megatron_setup.MegatronLoop``); nothing else in agoq imports agoq.train except the command-line tools
(``agoq.convert.__main__``). It is the only
agoq package that reads the environment (``environment``: torchrun's variables, kernel switches;
tests/unit/test_config_boundary.py).
"""
