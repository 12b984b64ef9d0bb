"""The contract table (agoq.megatron.contract.CONTRACT) holds on the pinned megatron-core, and compat reports a drift as
one clear error."""

from __future__ import annotations

import pytest

from agoq.megatron import compat, contract

pytestmark = pytest.mark.megatron


def test_contract_holds_on_installed_megatron():
    assert compat.contract_problems() == []


def test_drift_is_listed_with_the_fix(monkeypatch):
    drifted = contract.CONTRACT + (
        contract.Symbol("megatron.core.models.gpt:GPTModel", "test", params=("no_such_param",)),
        contract.Symbol("megatron.core.no_such_module:Thing", "test"),
        contract.Symbol("megatron.core.distributed:DistributedDataParallelConfig", "test", fields=("nope",)),
    )
    with pytest.raises(RuntimeError) as exc:
        compat.check(drifted)
    message = str(exc.value)
    assert "3 problem(s)" in message
    assert "no_such_param" in message and "no_such_module" in message and "'nope'" in message
    assert "pip install megatron-core==0.19.2" in message


def test_wrong_version_is_reported(monkeypatch):
    monkeypatch.setattr(compat, "installed_mcore_version", lambda: "0.20.0")
    problems = compat.contract_problems()
    assert problems == ["megatron-core 0.20.0 is installed; agoq supports ('0.19.2',)"]


def test_versions_line_names_the_installed_release_not_a_git_tag(monkeypatch):
    """megatron-core's own __version__ appends `git rev-parse HEAD` of the repository its install folder sits in (a
    .venv inside agoq's checkout printed agoq's commit as megatron-core's); the start-up line reads pip's release."""
    import megatron.core

    from agoq.train.pretrain import versions_line

    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+0123abc")  # what the git suffix looks like
    line = versions_line()
    assert f"| megatron-core {compat.installed_mcore_version()} |" in line and "0123abc" not in line, line
    assert compat.installed_mcore_version() in compat.SUPPORTED_MCORE_VERSIONS
