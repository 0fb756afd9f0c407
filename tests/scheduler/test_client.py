"""scheduler.client's requests: every id goes into its URL as one path segment, whatever it holds."""

from __future__ import annotations

import urllib.parse

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.client import SchedulerApiError, SchedulerClient


def _client(seen: list[httpx.Request]) -> SchedulerClient:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404, json={"detail": "no such job"})

    return SchedulerClient("http://sched.test:7800", "tok", transport=httpx.MockTransport(answer))


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40) | st.sampled_from([".", "..", "a/../../v1/tokens", "x?user=bob", "#", "%2F"]))
def test_an_id_is_one_path_segment_never_another_path_or_a_query(ident):
    seen: list[httpx.Request] = []
    with _client(seen) as c:
        for call, prefix, suffix in ((c.get, "/v1/jobs/", ""), (c.cancel, "/v1/jobs/", ""),
                                     (c.events, "/v1/jobs/", "/events"), (c.revoke_token, "/v1/tokens/", "")):
            try:
                call(ident)
            except SchedulerApiError as exc:
                assert exc.status == 404
            req = seen[-1]
            path = req.url.raw_path.decode("ascii")
            assert path.startswith(prefix), path
            segment, _, query = path[len(prefix):].partition("?")
            assert segment.endswith(suffix)
            segment = segment[:len(segment) - len(suffix)] if suffix else segment
            assert "/" not in segment and "#" not in segment and segment not in (".", ".."), path
            assert urllib.parse.unquote(segment) == ident
            assert query in ("", "after=0"), path  # nothing of the id leaked into the query
