"""agoq's plugin for megatron-core: layer spec and layers, DDP / optimizer seams, checkpoint contract, CPU mode.

With the reference trainer (:mod:`agoq.train`, its client) the only agoq packages that import megatron
(house rule 1). No command line and no training loop here (tests/unit/test_boundaries.py): a trainer builds
``agoq.config.AgoqConfig`` and passes it in.
"""
