"""AgoqConfig's typed fields: the gradient format parsed once (GradsConfig.format a QuantFormat, written by name
into checkpoints and read back), the optimizer's state formats as one record, and the kernels section (host paths,
not saved)."""

import pytest

from agoq.config import AgoqConfig
from agoq.config.sections import GradsConfig, KernelsConfig, OptimizerOptions, StateFormats
from agoq.config.values import GradsFormatError
from agoq.formats import QuantFormat, parse_format


def test_grads_format_is_parsed_once_and_saved_by_name():
    grads = GradsConfig(format="int8_b256", mode="reduce")
    assert isinstance(grads.format, QuantFormat) and grads.format == parse_format("int8_b256")
    assert grads.quantized and grads.format_name == "int8_b256"
    assert GradsConfig(format=parse_format("int8_b256")) == GradsConfig(format="int8_b256")  # a parsed one is kept
    floats = GradsConfig(format="bf16", reduce_in_bf16=True)
    assert not floats.quantized and floats.format_name == "bf16"
    assert GradsConfig().format is None and not GradsConfig().quantized
    config = AgoqConfig(grads=grads)
    data = config.as_dict()
    assert data["grads"]["format"] == "int8_b256"  # checkpoints keep the name, as before
    assert AgoqConfig.from_dict(data) == config


@pytest.mark.parametrize("name, why", [("cuint8_b32", "unsigned"), ("int8_b256_sr", "stochastic"),
                                       ("int9_b256", "unknown format"), ("nf4", "unknown format")])
def test_grads_format_refusals_name_the_flag(name, why):
    with pytest.raises(GradsFormatError, match=f"--agoq-grads {name}.*{why}"):
        GradsConfig(format=name)


def test_optimizer_state_formats_are_one_typed_record():
    adamw = OptimizerOptions(kind="adamw", moments="fp8", master="split32")
    assert adamw.states == StateFormats(parse_format("fp8e4m3_b128"), parse_format("fp8e5m2_b128"), "split32")
    assert adamw.states.names == adamw.state_formats == ("fp8e4m3_b128", "fp8e5m2_b128")
    lion = OptimizerOptions(kind="lion")
    assert lion.states.v is None and lion.states.names == ("cint8_b32",)
    assert OptimizerOptions().states is None  # Megatron's Adam: fp32 states


def test_kernels_section_is_not_saved():
    """Host paths (direct launches, the plain SwiGLU + FP8 fc2 fusion): a checkpoint resumes under either."""
    config = AgoqConfig(kernels=KernelsConfig(fast_launch=False, fuse_swiglu_fp8=False))
    assert "kernels" not in config.as_dict()
    assert AgoqConfig.from_dict(config.as_dict()).kernels == KernelsConfig()
    assert AgoqConfig.from_flags({}, kernels=config.kernels).kernels == config.kernels
