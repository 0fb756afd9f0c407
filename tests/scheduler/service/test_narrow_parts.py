"""The service's parts are wired by narrow interfaces: the translator and recovery see the service
through a Protocol that names what they use (and they use nothing else), the cluster view takes plain
arguments; no part takes ``svc: Any``."""

from __future__ import annotations

import ast
import typing

import pytest

from scheduler.service.live import SchedulerService
from scheduler.service.recovery import RecoveryHost
from scheduler.service.store import JobStore
from scheduler.service.translate import TranslatorHost
from tests.conftest import ROOT
from tests.source_tree import parsed, sources


def _members(proto: type) -> set[str]:
    return set(typing.get_type_hints(proto)) | {n for n, v in vars(proto).items()
                                                if callable(v) and not n.startswith("_")}


def _svc_uses(path) -> set[str]:
    """Attributes read through ``svc`` or ``self.svc`` in a module."""
    used = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "svc") or (isinstance(v, ast.Attribute) and v.attr == "svc"):
                used.add(node.attr)
    return used


@pytest.mark.parametrize("module, proto", [("translate", TranslatorHost), ("recovery", RecoveryHost)])
def test_a_part_uses_only_what_its_protocol_names(module, proto):
    used = _svc_uses(ROOT / "scheduler" / "service" / f"{module}.py")
    assert used, "the scan sees the part's uses"
    assert used <= _members(proto), f"{module}.py reaches past its protocol: {sorted(used - _members(proto))}"


def test_the_service_is_each_protocol(tmp_path):
    svc = SchedulerService(JobStore(tmp_path / "s.db"))
    for proto in (TranslatorHost, RecoveryHost):
        missing = sorted(m for m in _members(proto) if not hasattr(svc, m))
        assert not missing, f"SchedulerService lacks {missing} of {proto.__name__}"


def test_no_part_of_the_service_takes_the_whole_service_untyped():
    bad = []
    for path in sources("scheduler", "aggregator", "nodesvc", "rdma"):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.arg) and node.arg in ("svc", "service", "client") and \
                    isinstance(node.annotation, ast.Name) and node.annotation.id == "Any":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.arg}: Any")
    assert not bad, bad
