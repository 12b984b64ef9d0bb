"""python -m agoq.convert agoq-to-hf: the checkpoint to read is named in the error when it is not there."""

from __future__ import annotations

import pytest

from agoq.megatron.ckpt import ckpt_files, hf_checkpoint


def test_an_iteration_that_was_not_saved_names_the_saved_ones(tmp_path):
    for it in (2, 10):
        (ckpt_files.iteration_dir(tmp_path, it)).mkdir()
        (ckpt_files.iteration_dir(tmp_path, it) / ckpt_files.PROGRESS_FILE).write_text("{}")
    (tmp_path / ckpt_files.TRACKER_FILE).write_text("10\n")
    # it used to say 'iter_0000007: not a complete agoq checkpoint (agoq_progress.json missing)'
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of iteration 7 \(iter_0000007 does not exist\); "
                                                r"saved iterations: 2, 10. Pass one of them, or leave --iteration out"):
        hf_checkpoint.checkpoint_source(tmp_path, 7)
    assert hf_checkpoint.checkpoint_source(tmp_path, 2) == ckpt_files.iteration_dir(tmp_path, 2)
    assert hf_checkpoint.checkpoint_source(tmp_path) == ckpt_files.iteration_dir(tmp_path, 10)
    ckpt_files.iteration_dir(tmp_path, 3).mkdir()  # a save that did not finish keeps its own message
    with pytest.raises(FileNotFoundError, match="iter_0000003: not a complete agoq checkpoint"):
        hf_checkpoint.checkpoint_source(tmp_path, 3)


# agoq-to-hf's model shape: the checkpoint's record, a --config only where the record is silent (issue 42)
_OLD_MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 192, "vocab_size": 384, "seq_length": 128}  # a record saved before issue 42
_NEW_MODEL = {**_OLD_MODEL, "rotary_base": 500000, "norm_epsilon": 1e-6, "rope_scaling": True,
              "rope_scaling_factor": 8.0, "share_embeddings_and_output_weights": True, "unpadded_vocab_size": 300}


def _dims(tmp_path, model: dict, yaml_text: str | None):
    from agoq.convert.__main__ import _export_dims
    from agoq.convert.request import ExportRequest
    from agoq.megatron.ckpt.resume import RECORD_KEY

    config = None
    if yaml_text is not None:
        config = tmp_path / "model.yaml"
        config.write_text(yaml_text)
    return _export_dims(ExportRequest(load_dir=tmp_path, output=tmp_path / "out", config=config),
                        {RECORD_KEY: {"model": model}})


def test_export_takes_the_recorded_shape_and_refuses_a_conflicting_yaml(tmp_path):
    dims, padded, assumed = _dims(tmp_path, _NEW_MODEL, None)  # no --config needed
    assert (dims.rotary_base, dims.norm_epsilon, dims.rope_scaling_factor, dims.tie_word_embeddings) == (
        500000, 1e-6, 8.0, True)
    assert (dims.vocab_size, padded, assumed) == (300, 384, [])
    same = "num_layers: 4\nrotary_base: 500000\nuse_rope_scaling: true\nuntie_embeddings_and_output_weights: false\n"
    assert _dims(tmp_path, _NEW_MODEL, same)[0] == dims
    for line, message in (("rotary_base: 10000", "rotary_base 10000, but the checkpoint was saved with rotary_base "
                                                 "500000; drop the key"),
                          ("norm_epsilon: 1.0e-05", "norm_epsilon 1e-05, but the checkpoint was saved with "
                                                    "norm_epsilon 1e-06"),
                          ("rope_scaling_factor: 32.0", "rope_scaling_factor 32.0, but the checkpoint was saved with "
                                                        "rope_scaling_factor 8.0"),
                          ("use_rope_scaling: false", "use_rope_scaling False, but the checkpoint was saved with "
                                                      "rope_scaling True"),
                          ("untie_embeddings_and_output_weights: true", "untie_embeddings_and_output_weights True, "
                           "but the checkpoint was saved with share_embeddings_and_output_weights True"),
                          ("hidden_size: 128", "hidden_size 128, but the checkpoint was saved with hidden_size 64")):
        with pytest.raises(ValueError, match=f"model.yaml: {line.split(':')[0]}.*{message.split(', but')[1][:30]}"):
            _dims(tmp_path, _NEW_MODEL, line + "\n")


def test_export_of_an_older_checkpoint_needs_its_config_and_says_what_it_assumed(tmp_path):
    with pytest.raises(ValueError, match="does not record its whole model shape .rotary_base, norm_epsilon: saved "
                                         "before agoq recorded it.: pass the run's --config YAML"):
        _dims(tmp_path, _OLD_MODEL, None)
    dims, _, assumed = _dims(tmp_path, _OLD_MODEL, "rotary_base: 500000\nnorm_epsilon: 1.0e-06\n")
    assert (dims.rotary_base, dims.norm_epsilon, dims.tie_word_embeddings) == (500000, 1e-6, False)
    assert dict(assumed) == {"rope_scaling": False, "share_embeddings_and_output_weights": False}
    # the bug of issue 42: a YAML without rotary_base gave rope_theta 10000 without a word; now it is reported
    dims, _, assumed = _dims(tmp_path, _OLD_MODEL, "norm_epsilon: 1.0e-06\n")
    assert dims.rotary_base == 10000 and ("rotary_base", 10000) in assumed
