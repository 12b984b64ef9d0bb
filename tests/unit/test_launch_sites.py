"""Per-size launch-site caches stay bounded (agoq.kernels._launch.remember_site, MAX_LAUNCH_SITES).

The caches fill only on CUDA (tests/gpu/test_saved_act_gpu.py drives the real ones past a lowered bound);
here: the bound itself, and that every site cache in agoq/kernels inserts through remember_site (a plain
``X_SITES[key] = site`` would grow without end)."""

from __future__ import annotations

import ast
from pathlib import Path

from agoq.kernels import _launch

KERNELS = Path(__file__).resolve().parents[2] / "agoq" / "kernels"


def test_remember_site_never_exceeds_its_bound_and_drops_the_oldest():
    sites: dict = {}
    for i in range(3 * 8):
        assert _launch.remember_site(sites, ("fmt", i), i, limit=8) == i
        assert len(sites) <= 8
    assert list(sites) == [("fmt", i) for i in range(16, 24)]  # the newest 8 remain
    assert sites[("fmt", 23)] == 23


def test_default_bound_is_the_named_constant(monkeypatch):
    monkeypatch.setattr(_launch, "MAX_LAUNCH_SITES", 3)
    sites: dict = {}
    for i in range(10):
        _launch.remember_site(sites, i, i)
    assert len(sites) == 3


def test_site_caches_insert_only_through_remember_site():
    raw = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                            and t.value.id.endswith("_SITES")):
                        raw.append(f"{path.name}:{node.lineno}")
    assert not raw, f"unbounded site-cache inserts (use _launch.remember_site): {raw}"
    not_caches = ("_CHECK_SITES", "MAX_LAUNCH_SITES")
    names = {n.id for p in KERNELS.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Name) and n.id.endswith("_SITES") and n.id not in not_caches}
    covered = {"_QUANT_SITES", "_DEQUANT_SITES", "_FWD_SITES", "_DQ_SITES", "_ROPE_SITES",
               "_QKV_ROPE_SITES"}  # caches this test covers
    assert names == covered
