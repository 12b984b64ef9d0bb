"""compat.CONTRACT holds on the pinned megatron-core, and a drift is reported as one clear error."""

from __future__ import annotations

import pytest

from agoq.megatron import compat

pytestmark = pytest.mark.megatron


def test_contract_holds_on_installed_megatron():
    assert compat.contract_problems() == []


def test_drift_is_listed_with_the_fix(monkeypatch):
    drifted = compat.CONTRACT + (
        compat.Symbol("megatron.core.models.gpt:GPTModel", "test", params=("no_such_param",)),
        compat.Symbol("megatron.core.no_such_module:Thing", "test"),
        compat.Symbol("megatron.core.distributed:DistributedDataParallelConfig", "test", fields=("nope",)),
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
