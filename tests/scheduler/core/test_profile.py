"""Profiles: the packaged ones load, bad ones get a clear ProfileError (hypothesis too)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.profile import ProfileError, load_profile, packaged_profiles, parse_profile


def test_all_packaged_profiles_load():
    names = packaged_profiles()
    assert {"fifo", "srtf", "las", "tiresias", "gittins", "gandiva", "horus", "iadeep", "synergy", "dlshare"} <= set(names)
    for n in names:
        assert load_profile(n).name == n


def test_profile_errors_are_clear(tmp_path):
    with pytest.raises(ProfileError, match="no profile 'nope'"):
        load_profile("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("[order\n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(bad)
    bad.write_text('[order]\nplugin = "fifo"\n[placement]\nshare = "sometimes"\n')
    with pytest.raises(ProfileError, match="placement.share"):
        load_profile(bad)
    bad.write_text('[order]\nplugin = "lottery"\n')
    with pytest.raises(ProfileError, match="unknown order plugin 'lottery'"):
        load_profile(bad)


scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 200), st.floats(allow_nan=False), st.text(max_size=10))
plugin_names = st.sampled_from(["fifo", "las", "gittins", "consolidate", "random", "nope", "proportional", "synergy"])
spec = st.one_of(plugin_names, st.fixed_dictionaries({"plugin": plugin_names},
                                                    optional={"weight": scalar, "args": st.dictionaries(st.text(max_size=5), scalar, max_size=2)}),
                 scalar)
profile = st.fixed_dictionaries({}, optional={
    "name": scalar, "order": spec, "filter": st.lists(spec, max_size=2), "score": st.lists(spec, max_size=2),
    "allocate": spec, "placement": st.dictionaries(
        st.sampled_from(["share", "max_share", "share_max_gpus", "backfill", "nodes_to_score_percent", "min_run_s", "x"]),
        st.one_of(scalar, st.sampled_from(["never", "when_full", "always"])), max_size=4),
    "bogus": scalar})


@settings(max_examples=400, deadline=None)
@given(profile)
def test_profile_loader_fails_only_with_profile_error(d):
    try:
        p = parse_profile(d, "fuzz")
    except ProfileError as exc:
        assert "fuzz" in str(exc)
        return
    assert p.share in ("never", "when_full", "always") and p.max_share >= 1
