"""The checks between agoq and megatron-core: the supported version and the contract table, checked at start-up.

Seam card
---------
Touches: nothing (read-only introspection of the symbols listed in :data:`agoq.megatron.contract.CONTRACT`).
Why: agoq relies on private and fast-moving parts of megatron-core. One table, checked before any
  work, turns a silent behaviour change after an upgrade into one error that lists every mismatch.
Verified on: megatron-core 0.19.2 (the only supported version; pinned in pyproject.toml).
Guarded by: ``tests/megatron/test_contract.py``.

This file holds the checks (:data:`SUPPORTED_MCORE_VERSIONS`, :func:`installed_mcore_version`,
:func:`contract_problems`, :func:`check`); the table they read (:class:`~agoq.megatron.contract.Symbol` rows,
:data:`~agoq.megatron.contract.CONTRACT`) is data in ``agoq/megatron/contract.py``, where new rows go. The checks
take any table of rows (``agoq.megatron.megatron_lm.MEGATRON_TRAINING_CONTRACT`` is checked the same way).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from agoq.megatron.contract import CONTRACT, Symbol

SUPPORTED_MCORE_VERSIONS = ("0.19.2",)


def installed_mcore_version() -> str:
    """The installed megatron-core release (pip's version, local build tag dropped).

    ``megatron.core.package_info.__version__`` differs between wheels of one release (measured:
    ``0.19.2`` vs ``0.19.2+5c1018a`` for the two 0.19.2 manylinux wheels), so the distribution
    metadata is read instead.
    """
    from importlib import metadata

    from packaging.version import Version

    try:
        return Version(metadata.version("megatron-core")).public
    except metadata.PackageNotFoundError as exc:  # pragma: no cover - exercised only without megatron-core
        raise RuntimeError(
            "megatron-core is not installed. Install the supported version: "
            f"pip install megatron-core=={SUPPORTED_MCORE_VERSIONS[0]}"
        ) from exc


def _resolve(path: str):
    module_name, _, qualname = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _param_names(obj) -> set[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    return set(inspect.signature(target).parameters)


def _check_symbol(sym: Symbol) -> list[str]:
    try:
        obj = _resolve(sym.path)
    except (ImportError, AttributeError) as exc:
        return [f"{sym.path}: missing ({type(exc).__name__}: {exc})"]
    problems = []
    if sym.params:
        missing = [p for p in sym.params if p not in _param_names(obj)]
        if missing:
            problems.append(f"{sym.path}: parameters {missing} not found")
    if sym.fields:
        names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        missing = [f for f in sym.fields if f not in names]
        if missing:
            problems.append(f"{sym.path}: dataclass fields {missing} not found")
    missing_attrs = [a for a in sym.attrs if not hasattr(obj, a)]
    if missing_attrs:
        problems.append(f"{sym.path}: attributes {missing_attrs} not found")
    return problems


def contract_problems(contract: tuple[Symbol, ...] = CONTRACT) -> list[str]:
    """Every mismatch between ``contract`` and the installed megatron-core (empty when all hold)."""
    problems = []
    version = installed_mcore_version()
    if version not in SUPPORTED_MCORE_VERSIONS:
        problems.append(f"megatron-core {version} is installed; agoq supports {SUPPORTED_MCORE_VERSIONS}")
    for sym in contract:
        problems.extend(_check_symbol(sym))
    return problems


def check(contract: tuple[Symbol, ...] = CONTRACT) -> None:
    """Raise one ``RuntimeError`` listing every contract mismatch, with the fix."""
    problems = contract_problems(contract)
    if problems:
        listing = "\n  - ".join(problems)
        raise RuntimeError(
            f"agoq's megatron-core contract does not hold ({len(problems)} problem(s)):\n  - {listing}\n"
            f"Install the supported version: pip install megatron-core=={SUPPORTED_MCORE_VERSIONS[0]}"
        )
