"""The vector selectors of a PromQL expression (``name{label="v", ...}``), so that a test can ask a
live Prometheus whether each series a rule or a dashboard reads is really scraped.

Not a PromQL parser: a tokenizer that knows where PromQL puts names that are not series (function
and aggregation names before ``(``, the label lists of ``by``/``without``/``on``/``ignoring``/
``group_left``/``group_right``, keywords, ``offset`` durations, strings, ranges in ``[...]``).
Debian's Prometheus 2.42 has no API to parse a query, and ``promtool`` does not list selectors.
"""

from __future__ import annotations

import re

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "atan2", "inf", "nan", "start", "end"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*")


class PromQLError(ValueError):
    pass


def _string_end(text: str, i: int) -> int:
    """The index after the string starting at ``text[i]`` (a quote or backtick)."""
    q = text[i]
    j = i + 1
    while j < len(text):
        if text[j] == "\\" and q != "`":
            j += 2
            continue
        if text[j] == q:
            return j + 1
        j += 1
    raise PromQLError(f"unterminated string at {i}")


def _block_end(text: str, i: int, close: str) -> int:
    """The index after the ``{...}``/``[...]``/``(...)`` block opening at ``text[i]`` (strings skipped)."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c in "\"'`":
            j = _string_end(text, j)
            continue
        if c == close:
            return j + 1
        j += 1
    raise PromQLError(f"unclosed {text[i]!r} at {i}")


def selectors(expr: str) -> list[str]:
    """Every vector selector of ``expr``, as written (name and ``{...}`` matchers, whitespace
    squeezed), in order of appearance, each once."""
    out: list[str] = []
    i, n = 0, len(expr)
    prev_word = ""
    while i < n:
        c = expr[i]
        if c.isspace():
            i += 1
            continue
        if c == "#":  # a comment runs to the end of the line
            while i < n and expr[i] != "\n":
                i += 1
            continue
        if c in "\"'`":
            i = _string_end(expr, i)
            prev_word = ""
            continue
        if c == "[":
            i = _block_end(expr, i, "]")
            prev_word = ""
            continue
        if c == "(" and prev_word in LABEL_LISTS:
            i = _block_end(expr, i, ")")  # a list of label names, not series
            prev_word = ""
            continue
        if c == "{":  # a selector with no name: {job="x"}
            j = _block_end(expr, i, "}")
            _add(out, "", expr[i:j])
            i = j
            prev_word = ""
            continue
        if c.isdigit() or (c == "." and i + 1 < n and expr[i + 1].isdigit()):
            m = _NUMBER.match(expr, i)
            i = m.end() if m else i + 1
            prev_word = ""
            continue
        m = _IDENT.match(expr, i)
        if m is None:
            i += 1
            prev_word = ""
            continue
        word = m.group(0)
        j = m.end()
        k = j
        while k < n and expr[k].isspace():
            k += 1
        if prev_word == "offset" or word.lower() in KEYWORDS:
            if prev_word == "offset":  # a duration such as 5m is a number; "offset -5m" too
                word = ""
            i = j
            prev_word = word.lower()
            continue
        if k < n and expr[k] == "(":  # a function or an aggregation: sum(...), rate(...)
            i = j
            prev_word = word
            continue
        if k < n and expr[k] in "bw" and _IDENT.match(expr, k) and _IDENT.match(expr, k).group(0) in ("by",
                                                                                                    "without"):
            i = j  # sum by (x) (...): an aggregation whose modifier comes first
            prev_word = word
            continue
        if k < n and expr[k] == "{":
            end = _block_end(expr, k, "}")
            _add(out, word, expr[k:end])
            i = end
        else:
            _add(out, word, "")
            i = j
        prev_word = ""
    return out


def _add(out: list[str], name: str, block: str) -> None:
    sel = name + _squeeze(block)
    if sel and sel not in out:
        out.append(sel)


def _squeeze(block: str) -> str:
    """``{ a = "x" , b=~"y" }`` -> ``{a="x", b=~"y"}`` (strings kept as they are)."""
    if not block:
        return ""
    parts, buf, i = [], "", 1
    while i < len(block) - 1:
        c = block[i]
        if c in "\"'`":
            j = _string_end(block, i)
            buf += block[i:j]
            i = j
            continue
        if c == ",":
            parts.append(buf.strip())
            buf = ""
        elif not c.isspace():
            buf += c
        i += 1
    if buf.strip():
        parts.append(buf.strip())
    return "{" + ", ".join(p for p in parts if p) + "}"


__all__ = ["PromQLError", "selectors"]
