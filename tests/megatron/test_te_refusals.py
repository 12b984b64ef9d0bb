"""agoq with Transformer Engine: the settings that do not compose are refused by name (agoq/megatron/te.py), and
asking for TE where it is not installed (this CPU machine) stops with one line naming the install."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.megatron

from agoq.config import AgoqConfig  # noqa: E402
from agoq.megatron import te  # noqa: E402


def _config(**flags):
    return AgoqConfig.from_flags({"agoq_disable": False, **flags})


@pytest.mark.skipif(te.te_available(), reason="Transformer Engine is installed here")
def test_missing_te_names_the_install():
    with pytest.raises(RuntimeError, match=r"Transformer Engine is not installed; pip install .*transformer-engine"):
        te.te_layer_spec()


@pytest.mark.parametrize("flags,fusion,match", [
    ({"agoq_fp8": "delayed"}, False, r"--agoq-fp8 delayed .* --fp8-format hybrid --fp8-recipe delayed"),
    ({"agoq_grads": "int8_b256"}, True, r"store mode with --gradient-accumulation-fusion.*--no-gradient-accumulation"),
])
def test_non_composing_settings_are_refused(flags, fusion, match):
    with pytest.raises(ValueError, match=match):
        te.check_te_composition(_config(**flags), gradient_accumulation_fusion=fusion)


def test_composing_settings_pass():
    te.check_te_composition(_config(agoq_grads="int8_b256", agoq_optimizer="adamw"), gradient_accumulation_fusion=False)
    reduce_mode = _config(agoq_grads="int8_b256", agoq_grads_mode="reduce")
    te.check_te_composition(reduce_mode, gradient_accumulation_fusion=True)
    te.check_te_composition(_config(agoq_disable=True, agoq_fp8="delayed"), gradient_accumulation_fusion=True)
