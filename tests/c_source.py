"""Reading csrc/ the simple way, for the checks of tests/test_c_layout.py: which C file calls which
(a file that calls, or takes the address of, a non-static function defined in another file has an
arrow to it), circles in that graph, and whether a ``.cdef`` says what its header says.

Plain text parsing (comments, strings and preprocessor lines stripped, braces counted): enough for
this code base's style, and every check has a test on a synthetic input that it can fail.
"""

from __future__ import annotations

import pathlib
import re

_NOT_FUNCTIONS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "case", "defined",
                  "__attribute__", "typeof", "_Alignof", "alignof"}


def strip(src: str) -> str:
    """The C source without comments, string and character literals, or preprocessor lines."""
    src = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r'"(\\.|[^"\\\n])*"', '""', src)
    src = re.sub(r"'(\\.|[^'\\\n])*'", "''", src)
    return re.sub(r"^[ \t]*#[^\n]*(\\\n[^\n]*)*", "", src, flags=re.M)


def functions(src: str) -> tuple[dict[str, bool], set[str]]:
    """The functions a C file defines (name -> static?) and every identifier it uses."""
    s = strip(src)
    defs: dict[str, bool] = {}
    depth = 0
    last = 0
    for i, c in enumerate(s):
        if c == "{":
            if depth == 0:
                head = s[last:i]
                m = re.search(r"(\w+)\s*\(([^()]|\([^()]*\))*\)\s*$", head)
                if m and m.group(1) not in _NOT_FUNCTIONS and "=" not in head:
                    defs[m.group(1)] = re.search(r"\bstatic\b", head) is not None
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                last = i + 1
        elif c == ";" and depth == 0:
            last = i + 1
    return defs, set(re.findall(r"\b[A-Za-z_]\w*\b", s))


def call_graph(files: list[pathlib.Path]) -> dict[str, dict[str, list[str]]]:
    """file name -> {file name it calls into: [the functions]}."""
    info = {f.name: functions(f.read_text()) for f in files}
    owner: dict[str, str] = {}
    for name, (defs, _) in info.items():
        for fn, static in defs.items():
            if not static:
                owner[fn] = name
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in info}
    for name, (defs, used) in info.items():
        for ident in sorted(used):
            target = owner.get(ident)
            if target is not None and target != name and ident not in defs:
                graph[name].setdefault(target, []).append(ident)
    return graph


def find_circle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, {})):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


# --- .cdef against header ----------------------------------------------------------------------------

def _eval(expr: str, known: dict[str, object]) -> object:
    """A #define's value: an integer when it is an integer expression, else its text."""
    py = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr.strip())
    py = re.sub(r"\((?:u?int\d+_t|unsigned|int|long)\)", "", py)
    try:
        return int(eval(py, {"__builtins__": {}}, dict(known)))  # noqa: S307 - our own headers' constants
    except Exception:  # noqa: BLE001 - not an integer expression: compare the text
        return " ".join(expr.split())


def _defines(src: str) -> dict[str, object]:
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    out: dict[str, object] = {}
    for m in re.finditer(r"^[ \t]*#define[ \t]+(\w+)[ \t]+([^\n]+)$", src, flags=re.M):
        out[m.group(1)] = _eval(m.group(2), {k: v for k, v in out.items() if isinstance(v, int)})
    return out


def _norm(text: str) -> str:
    text = " ".join(text.split())
    return re.sub(r"\s*([*(),;{}\[\]])\s*", r"\1", text)


def _declarators(decl: str, consts: dict[str, object]) -> list[str]:
    """``uint64_t a, *b[N]`` -> ['uint64_t a', 'uint64_t *b[8]'] (N's value)."""
    decl = _norm(decl)
    m = re.match(r"^((?:(?:const|unsigned|signed|struct|volatile)\s+)*\w+)\s*(.*)$", decl)
    if not m:
        return [decl]
    base, rest = m.group(1), m.group(2)
    out = []
    for d in rest.split(","):
        d = re.sub(r"\[(\w+)\]", lambda a: f"[{consts.get(a.group(1), a.group(1))}]", d.strip())
        out.append(f"{base} {d}")
    return out


def _statements(src: str) -> tuple[dict[str, list[str]], set[str]]:
    """Struct typedefs (name -> fields) and the other top-level declarations, normalised; function
    bodies (static inline helpers) are left out."""
    s = strip(src)
    consts = {k: v for k, v in _defines(src).items() if isinstance(v, int)}
    structs: dict[str, list[str]] = {}
    others: set[str] = set()
    depth, start, body_start = 0, 0, -1
    i = 0
    while i < len(s):
        c = s[i]
        if c == "{":
            if depth == 0:
                body_start = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and not re.search(r"\b(struct|union|enum)\b", s[start:body_start]):
                start = i + 1  # a function body: drop it
        elif c == ";" and depth == 0:
            stmt = s[start:i].strip()
            start = i + 1
            m = re.match(r"typedef\s+struct\s+\w*\s*\{(.*)\}\s*(\w+)\s*$", stmt, flags=re.S)
            if m:
                fields = [f for part in m.group(1).split(";") if part.strip()
                          for f in _declarators(part, consts)]
                structs[m.group(2)] = fields
            elif stmt:
                others.add(_norm(stmt))
        i += 1
    return structs, others


def cdef_disagreements(cdef: str, header: str) -> list[str]:
    """What the .cdef declares differently from its header (empty: they agree).  The .cdef may
    declare less than the header, never something else."""
    problems = []
    hdefs, cdefs = _defines(header), _defines(cdef)
    for name, value in cdefs.items():
        if name not in hdefs:
            problems.append(f"#define {name}: not in the header")
        elif hdefs[name] != value:
            problems.append(f"#define {name}: {value!r} here, {hdefs[name]!r} in the header")
    hstructs, hothers = _statements(header)
    cstructs, cothers = _statements(cdef)
    for name, fields in cstructs.items():
        if name not in hstructs:
            problems.append(f"struct {name}: not in the header")
        elif hstructs[name] != fields:
            problems.append(f"struct {name}: fields {fields} here, {hstructs[name]} in the header")
    for stmt in sorted(cothers - hothers):
        problems.append(f"declaration not in the header: {stmt}")
    return problems
