"""The shape of csrc/: no circle between C files (a file that calls a function defined in another
file is an arrow to it), and every ``.cdef`` (what Python may call, in cffi's syntax) says what its
header says.  Each check is also run on a synthetic input that it must reject."""

from __future__ import annotations

import pathlib

import pytest

from tests.c_source import call_graph, cdef_disagreements, find_circle

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"


def test_no_circle_between_the_c_files():
    files = sorted(CSRC.glob("*.c"))
    graph = call_graph(files)
    assert len(files) > 10 and sum(len(v) for v in graph.values()) > 10  # the parser sees the real calls
    assert graph["pager_fault.c"].keys() >= {"pager_queue.c", "pager_core.c", "pager_io.c"}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle) + ": " + "; ".join(
        f"{a} calls {graph[a][b]} of {b}" for a, b in zip(circle, circle[1:]))


def _write(tmp: pathlib.Path, files: dict[str, str]) -> list[pathlib.Path]:
    for name, text in files.items():
        (tmp / name).write_text(text)
    return sorted(tmp / name for name in files)


def test_the_circle_check_finds_a_synthetic_pair_and_only_real_calls(tmp_path):
    pair = {
        "a.c": '#include "b.h"\n/* b_undo() in a comment is no call */\nint a_do(int x) {\n    return b_undo(x) + 1;\n}\n',
        "b.c": "static int helper(void) { return 2; }\nint b_undo(int x) {\n    if (x) return a_do(x - 1);\n"
               '    const char *s = "a_do(1)";\n    return helper() + (s != 0);\n}\n',
    }
    graph = call_graph(_write(tmp_path, pair))
    assert graph == {"a.c": {"b.c": ["b_undo"]}, "b.c": {"a.c": ["a_do"]}}
    assert find_circle(graph) in (["a.c", "b.c", "a.c"], ["b.c", "a.c", "b.c"])
    # one way only: no circle; a function passed by address is an arrow as much as a call
    oneway = dict(pair, **{"b.c": "int b_undo(int x) { return x; }\n"})
    graph = call_graph(_write(tmp_path, oneway))
    assert graph["b.c"] == {} and find_circle(graph) is None
    three = {
        "x.c": "void x_main(void) { y_go(); }\n",
        "y.c": "void *y_go(void) { return 0; }\nvoid y_start(void) { run(z_thread); }\n",
        "z.c": "void *z_thread(void *arg) { x_main(); return arg; }\n",
    }
    for f in tmp_path.iterdir():
        f.unlink()
    circle = find_circle(call_graph(_write(tmp_path, three)))
    assert circle is not None and set(circle) == {"x.c", "y.c", "z.c"}
    # the same name defined static in two files is two functions, neither an arrow
    for f in tmp_path.iterdir():
        f.unlink()
    graph = call_graph(_write(tmp_path, {"p.c": "static int cmp(void) { return 0; }\nint p(void) { return cmp(); }\n",
                                         "q.c": "static int cmp(void) { return 1; }\nint q(void) { return cmp(); }\n"}))
    assert graph == {"p.c": {}, "q.c": {}}


@pytest.mark.parametrize("cdef", sorted(CSRC.glob("*.cdef")), ids=lambda p: p.name)
def test_every_cdef_says_what_its_header_says(cdef):
    header = cdef.with_suffix(".h")
    assert header.exists(), f"{cdef.name} has no header"
    assert cdef_disagreements(cdef.read_text(), header.read_text()) == []


HEADER = """#ifndef X_H
#define X_H
#include <stdint.h>
#define X_MAX (1u << 4)
#define X_KIND 3 /* a kind */
typedef struct x_ev {
    int32_t kind; /* what */
    uint64_t a, *b;
    uint8_t tok[X_MAX];
} x_ev;
typedef struct x_box x_box;
/* make one */
int x_make(const x_ev *ev,
           x_box **out, char *err, size_t err_len);
static inline int x_twice(int v) { return 2 * v; }
#endif
"""
CDEF = """#define X_MAX 16
#define X_KIND 3
typedef struct x_ev {
    int32_t kind;
    uint64_t a;
    uint64_t *b;
    uint8_t tok[16];
} x_ev;
typedef struct x_box x_box;
int x_make(const x_ev *ev, x_box **out, char *err, size_t err_len);
"""


def test_the_cdef_check_accepts_a_faithful_subset_and_names_each_drift():
    assert cdef_disagreements(CDEF, HEADER) == []
    assert cdef_disagreements("#define X_KIND 3\n", HEADER) == []  # a subset is fine
    drifts = {
        "#define X_MAX 16": "#define X_MAX 32",
        "#define X_KIND 3": "#define X_KIND 3\n#define X_GONE 1",
        "    uint64_t *b;": "    uint32_t *b;",
        "    uint8_t tok[16];": "    uint8_t tok[16];\n    int32_t extra;",
        "x_box **out": "x_box *out",
        "typedef struct x_box x_box;": "typedef struct x_box x_box;\nvoid x_free(x_box *b);",
    }
    for old, new in drifts.items():
        assert old in CDEF
        problems = cdef_disagreements(CDEF.replace(old, new), HEADER)
        assert len(problems) == 1, (new, problems)
