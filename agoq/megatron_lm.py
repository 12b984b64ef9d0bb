"""``python -m agoq.megatron_lm path/to/pretrain_gpt.py <Megatron-LM flags> [--agoq-...]``: your Megatron-LM
``pretrain_gpt.py`` (megatron.training 0.19.x), unmodified, with agoq (under torchrun: ``torchrun ... -m
agoq.megatron_lm ...``). The door itself: agoq/train/megatron_lm_door.py; docs/megatron_lm.md."""

from __future__ import annotations


def main() -> None:
    from agoq.train.megatron_lm_door import main as door_main

    door_main()


if __name__ == "__main__":
    main()
