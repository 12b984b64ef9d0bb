"""agoq.plan: what each layer role stores under a policy (``agoq.plan.storage``) and the memory
planner (``python -m agoq.plan``, ``agoq.plan.memory``). Pure Python: no torch, no Megatron."""
