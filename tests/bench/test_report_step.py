"""bench/report.step: progress on a terminal (a spinner, the step, the time so far), nothing off one."""

from __future__ import annotations

import io
import sys

from bench import report


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_step_shows_its_words_on_a_terminal_and_nothing_in_a_pipe(monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with report.step("bench forecast") as outer:
        with report.step("forecast: vc_103959") as inner:  # steps nest
            inner("12/861 jobs submitted")
            outer("1/2")
    shown = tty.getvalue()
    assert "bench forecast" in shown and "forecast: vc_103959" in shown
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with report.step("bench forecast") as update:
        update("anything")
    assert pipe.getvalue() == ""
