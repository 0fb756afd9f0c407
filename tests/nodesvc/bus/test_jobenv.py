"""The job environment policy (nodesvc.bus.jobenv): one for the API and the nodes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nodesvc.bus import jobenv

NAMES = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=40)


def test_the_default_refuses_loader_variables_and_keeps_the_rest():
    assert jobenv.refused(["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "BASH_ENV", "CUDA_HOME",
                           "PYTHONPATH", "MY_VAR"]) == ["BASH_ENV", "GCONV_PATH", "LD_AUDIT", "LD_LIBRARY_PATH",
                                                        "LD_PRELOAD"]


def test_an_exact_name_in_the_allow_list_beats_the_deny_globs():
    allow = ["*", "LD_LIBRARY_PATH"]
    assert jobenv.refused(["LD_LIBRARY_PATH", "LD_PRELOAD"], allow) == ["LD_PRELOAD"]
    assert jobenv.refused(["LD_PRELOAD"], ["LD_*"]) == ["LD_PRELOAD"]  # a glob does not beat the deny list
    assert jobenv.refused(["A", "B"], ["A"], []) == ["B"]  # nothing outside the allow list


@given(st.lists(NAMES, max_size=20), st.lists(NAMES, max_size=5), st.lists(NAMES, max_size=5))
def test_refused_is_a_sorted_subset_and_never_raises(names, allow, deny):
    out = jobenv.refused(names, allow, deny)
    assert out == sorted(set(out)) and set(out) <= set(names)
    for n in set(names):
        assert (n in out) == (not jobenv.allowed(n, allow, deny))


@given(NAMES)
def test_every_ld_variable_is_refused_by_default(suffix):
    assert not jobenv.allowed("LD_" + suffix)
