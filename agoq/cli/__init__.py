"""The trainer's command line, one definition of each flag: ``scripts/pretrain_llama.py``'s parser
(:mod:`agoq.cli.flags`, with :mod:`~agoq.cli.optim_args`, :mod:`~agoq.cli.graph_args` and
:mod:`~agoq.cli.flag_hints`) and its ``--config FILE.yaml`` loader (:mod:`agoq.cli.config_file`).

Below the trainer (agoq/train, which checks and runs what these parse) so that ``python -m agoq.plan`` takes
the same flags and the same model files without reaching up into the trainer. Light imports only (argparse, yaml,
the torch-free agoq.config and agoq.policy): no torch, no megatron (tests/unit/test_boundaries.py)."""
