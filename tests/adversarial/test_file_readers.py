"""Attacks on every file dlshare reads: simulator traces, config files, scheduling profiles, the
shared data's CSV/JSON files and job-spec files.  An unlucky operator (a binary file, a BOM from a
Windows editor, a unit mistake of 1e308, /dev/zero) must get one clear error naming the file and,
for tables, the row, never a traceback, a hang or silent nonsense."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus import config
from nodesvc.cli import main
from scheduler import data, trace
from scheduler.profile import ProfileError, load_profile
from scheduler.trace import TraceError, load_trace, parse_trace

PHILLY = "job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s\n"
SYNERGY = "job_id,model,arrival_h,iterations,num_gpus\n"
GOOD_ROW = "j1,0,ResNet-50,64,1,100,10\n"


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


# --- traces --------------------------------------------------------------------------------------


@pytest.mark.parametrize("column,value", [("num_gpus", "1e400"), ("batch_size", "inf"), ("arrival_s", "nan"),
                                          ("total_steps", "-inf"), ("isolated_duration_s", "1e400"),
                                          ("num_gpus", "-3"), ("batch_size", "2.5")])
def test_trace_numbers_that_are_no_numbers_are_trace_errors(tmp_path, column, value):
    """Promise: a trace number that is infinite, NaN, negative or fractional where a count is due
    gives a TraceError naming the file, the row and the column, never an OverflowError traceback.
    (Issue 16, failure 6; num_gpus=1e400 and batch_size=inf were fixed on main before this suite.)"""
    row = dict(zip(PHILLY.strip().split(","), GOOD_ROW.strip().split(",")))
    row[column] = value
    p = _write(tmp_path, "t.csv", PHILLY + ",".join(row.values()) + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(p, check_models=False)
    assert str(p) in str(err.value) and "row 2" in str(err.value) and column in str(err.value)


@pytest.mark.parametrize("header,row,column", [
    (PHILLY, "j1,0,ResNet-50,64,1,100,1e308", "isolated_duration_s"),
    (PHILLY, "j1,1e300,ResNet-50,64,1,100,10", "arrival_s"),
    (PHILLY, "j1,0,ResNet-50,64,1000000000,100,10", "num_gpus"),
    (PHILLY, "j1,0,ResNet-50,1e12,1,100,10", "batch_size"),
    (PHILLY, "j1,0,ResNet-50,64,1,1e300,10", "total_steps"),
    (SYNERGY, "j1,alexnet,1e300,100,1", "arrival_h"),
    (SYNERGY, "j1,alexnet,0,1e300,1", "iterations"),
    (PHILLY, "j" * 300 + ",0,ResNet-50,64,1,100,10", "job_id"),
])
def test_absurd_trace_values_are_refused_with_finite_bounds(tmp_path, header, row, column):
    """Promise: every number of a trace row has a finite bound (31 years of seconds, 2**17 GPUs, ...);
    a value beyond it is a TraceError naming the column, not a simulation that prints a mean JCT
    of 1e304 h and nan utilisations.  (Issue 16, failure 6: isolated_duration_s=1e308 was taken.)"""
    p = _write(tmp_path, "t.csv", header + row + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(p, check_models=False)
    assert "row 2" in str(err.value) and column in str(err.value), err.value


def test_the_real_traces_fit_the_bounds():
    """Promise: the bounds refuse no row of the public traces (Philly vc_0e4a51, vc_103959, Synergy)."""
    for name in ("vc_0e4a51", "vc_103959", "static_100job"):
        jobs = load_trace(data.resolve_trace(name))
        assert jobs and all(math.isfinite(j.duration_s) and j.duration_s > 0 for j in jobs)


def test_a_binary_trace_names_the_file_and_the_row(tmp_path):
    """Promise: a trace that is not UTF-8 text gives a TraceError naming the file and the row where
    the bad bytes are, not a bare decode error.  (Issue 16, failure 6.)"""
    p = _write(tmp_path, "mixed.csv", (PHILLY + GOOD_ROW).encode() + b"j2,0,Res\xffNet,64,1,100,10\n")
    with pytest.raises(TraceError) as err:
        load_trace(p, check_models=False)
    assert str(p) in str(err.value) and "row 3" in str(err.value), err.value
    p = _write(tmp_path, "random.bin", bytes(range(256)) * 64)
    with pytest.raises(TraceError) as err:
        load_trace(p, check_models=False)
    assert str(p) in str(err.value) and "row " in str(err.value), err.value


def test_a_trace_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Promise: a UTF-8 byte-order mark (as Excel and Windows editors write) does not hide the first
    column: the trace parses exactly as without it.  (Issue 16, failure 6: "missing columns ['job_id']".)"""
    real = data.path("philly/vc_0e4a51.csv").read_text().splitlines(keepends=True)[:6]
    plain = _write(tmp_path, "plain.csv", "".join(real))
    bom = _write(tmp_path, "bom.csv", "\ufeff" + "".join(real))
    assert load_trace(bom) == load_trace(plain)
    assert len(load_trace(bom)) == 5
    assert parse_trace("\ufeff" + PHILLY + GOOD_ROW)[0].id == "j1"


def test_an_endless_file_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    """Promise: the trace reader reads at most MAX_TRACE_BYTES (+1) of a file, so /dev/zero or a
    runaway log cannot make it read forever; a directory is a clear error too."""
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 1 << 20)
    with pytest.raises(TraceError, match="larger than"):
        load_trace("/dev/zero", check_models=False)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path, check_models=False)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 st.lists(st.sampled_from(["j1", "0", "1e400", "inf", "nan", "-1", "1e308", "1e9", "64", "x",
                                           "\ufeff", "\x00", '"', "\r", "2.5", "ResNet-50", ""]),
                          min_size=1, max_size=30).map(lambda cells: (PHILLY + ",".join(cells) + "\n").encode())))
def test_fuzzed_trace_bytes_are_jobs_within_bounds_or_trace_errors(raw):
    """Promise: any bytes are either a list of jobs whose every number is finite and within its
    bound, or a TraceError; nothing else escapes the reader."""
    try:
        jobs = parse_trace(trace.decode_trace(raw, "<fuzz>"), "<fuzz>")
    except TraceError:
        return
    for j in jobs:
        assert 0 <= j.arrival_s <= trace.MAX_SECONDS and 0 < j.duration_s <= trace.MAX_SECONDS
        assert 1 <= j.gpus <= trace.MAX_GPUS and 0 <= j.batch_size <= trace.MAX_BATCH
        assert 0 <= j.steps <= trace.MAX_STEPS


def test_the_simulator_cli_reports_a_bad_trace_in_one_line(tmp_path, capsys):
    """Promise: `dlshare sim --trace FILE` with a binary file exits 2 with one line naming the file
    and row, no traceback."""
    p = _write(tmp_path, "bad.csv", (PHILLY + GOOD_ROW).encode() + b"\x00\xff\xfe garbage\n")
    assert main(["sim", "--trace", str(p), "--profile", "fifo", "--cluster", "1x4"]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "row 3" in err and "Traceback" not in err


@pytest.mark.parametrize("cluster", ["1x1:1:1e400", "1x1:1:nan", "100000000x8", "1x100000", "1x1:100000000:1"])
def test_the_simulator_cli_refuses_absurd_cluster_shapes(capsys, cluster):
    """Promise: a cluster shape with an infinite, NaN or absurdly large size exits 2 with a message,
    at once (before, 1e400 GB was an OverflowError traceback and 10**8 nodes ran until killed)."""
    assert main(["sim", "--synthetic", "3", "--profile", "fifo", "--cluster", cluster]) == 2
    err = capsys.readouterr().err
    assert "cluster" in err and "Traceback" not in err


def test_the_simulator_cli_bounds_the_restart_overhead(capsys):
    """Promise: --restart-overhead takes finite seconds up to a day; 1e308 exits 2 with a message."""
    with pytest.raises(SystemExit) as ex:
        main(["sim", "--synthetic", "3", "--profile", "fifo", "--restart-overhead", "1e308"])
    assert ex.value.code == 2
    assert "restart-overhead" in capsys.readouterr().err


# --- config files -------------------------------------------------------------------------------


def test_a_config_file_that_is_not_text_or_not_a_file_is_a_config_error(tmp_path):
    """Promise: a binary config file, a directory, or an endless file given as --config is a
    ConfigError naming the file, not a decode traceback or a hang."""
    for path in (_write(tmp_path, "bin.toml", b"\xff\xfe\x00[node]\n"), tmp_path, Path("/dev/zero")):
        with pytest.raises(config.ConfigError) as err:
            config.load(path, env={})
        assert str(path) in str(err.value)


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    """Promise: a UTF-8 byte-order mark at the start of a config file is ignored."""
    p = _write(tmp_path, "bom.toml", "\ufeff[dlshare]\nlog_level = \"debug\"\n")
    assert config.load(p, env={})["dlshare"]["log_level"] == "debug"


@pytest.mark.parametrize("where,value", [("file", "inf"), ("file", "nan"), ("file", "1e308"), ("env", "inf"),
                                         ("env", "nan"), ("env", "-1e300")])
def test_float_settings_must_be_finite_and_bounded(tmp_path, where, value):
    """Promise: every float setting (seconds, percentages, ratios) is finite and within +-1e9;
    inf, nan and 1e308 are ConfigErrors naming the key, from a file or the environment."""
    import nodesvc.cli.node  # noqa: F401 - registers [node]

    if where == "file":
        p = _write(tmp_path, "c.toml", f"[node]\ninterval = {value}\n")
        with pytest.raises(config.ConfigError, match="node.interval"):
            config.load(p, env={})
    else:
        with pytest.raises(config.ConfigError, match="DLSHARE_NODE_INTERVAL"):
            config.load(None, env={"DLSHARE_NODE_INTERVAL": value})


def test_the_cli_reports_a_bad_config_file_in_one_line(tmp_path, capsys):
    """Promise: `dlshare node --config BINARY --print-config` exits 2 with a config error naming
    the file, without a traceback."""
    p = _write(tmp_path, "bin.toml", bytes(range(256)))
    assert main(["node", "--config", str(p), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and str(p) in err and "Traceback" not in err


# --- scheduling profiles -----------------------------------------------------------------------


@pytest.mark.parametrize("text,key", [
    ('[order]\nplugin = "fifo"\n[[score]]\nplugin = "consolidate"\nweight = inf\n', "weight"),
    ('[order]\nplugin = "fifo"\n[[score]]\nplugin = "consolidate"\nweight = nan\n', "weight"),
    ('[order]\nplugin = "fifo"\n[[score]]\nplugin = "consolidate"\nweight = 1e308\n', "weight"),
    ('[order]\nplugin = "fifo"\n[placement]\nmin_run_s = nan\n', "min_run_s"),
    ('[order]\nplugin = "fifo"\n[placement]\nmin_run_s = inf\n', "min_run_s"),
    ('[order]\nplugin = "fifo"\n[placement]\nmax_share = 1000000000000\n', "max_share"),
    ('[order]\nplugin = "fifo"\n[placement]\nscan_limit = 1000000000000\n', "scan_limit"),
    ('[order]\nplugin = "las"\nargs = { quantum_s = inf }\n', "quantum_s"),
    ('[order]\nplugin = "tiresias"\nargs = { thresholds = [10.0, nan] }\n', "thresholds"),
])
def test_profile_numbers_must_be_finite_and_bounded(tmp_path, text, key):
    """Promise: every number of a profile (weights, placement values, plugin arguments) is finite
    and within a bound; TOML's inf and nan, and absurd sizes, are ProfileErrors naming the key."""
    p = _write(tmp_path, "p.toml", text)
    with pytest.raises(ProfileError) as err:
        load_profile(p)
    assert str(p) in str(err.value) and key in str(err.value), err.value


def test_a_profile_file_that_is_binary_or_has_a_bom(tmp_path):
    """Promise: a binary profile is a ProfileError naming the file; a BOM is ignored."""
    p = _write(tmp_path, "bin.toml", b"\xff\xfe\x00\x01")
    with pytest.raises(ProfileError) as err:
        load_profile(p)
    assert str(p) in str(err.value)
    p = _write(tmp_path, "bom.toml", "\ufeff" + (Path(__file__).parents[2] / "scheduler/profiles/fifo.toml").read_text())
    assert load_profile(p).order.plugin == "fifo"


# --- the shared data's CSV/JSON files -----------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A private data directory ($DLSHARE_DATA) holding copies of the real files, for the test to
    spoil; the loaders' caches are keyed by path, so nothing leaks into other tests."""
    real = data.data_dir()
    d = tmp_path / "data"
    for rel in ("gavel/throughputs.json", "synergy/sensitivity.json", "philly/runtimes.csv",
                "iadeep/colocation_util.csv"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes((real / rel).read_bytes())
    monkeypatch.setenv("DLSHARE_DATA", str(d))
    return d


@pytest.mark.parametrize("rel,content", [("gavel/throughputs.json", b"\xff\xfe{}"),
                                         ("gavel/throughputs.json", b'{"v100": '),
                                         ("synergy/sensitivity.json", b"\x00" * 64)])
def test_a_spoilt_json_data_file_is_a_value_error_naming_it(data_dir, rel, content):
    """Promise: a data JSON file that is binary or cut short gives a ValueError naming the file (the
    CLI prints it in one line), not a decode traceback."""
    (data_dir / rel).write_bytes(content)
    loader = data.gavel_throughputs if rel.startswith("gavel") else data.synergy_sensitivity
    with pytest.raises(ValueError) as err:
        loader()
    assert str(data_dir / rel) in str(err.value)


@pytest.mark.parametrize("rows,what", [("runtime\n10\nabc\n", "row 3"), ("runtime\n10\ninf\n", "row 3"),
                                       ("runtime\n10\n1e308\n", "row 3"), ("seconds\n10\n", "runtime"),
                                       ("runtime\n10\n\xff\n", "row 3")])
def test_a_spoilt_runtimes_table_names_the_row(data_dir, rows, what):
    """Promise: philly/runtimes.csv with a non-number, an infinite or absurd runtime, or a missing
    column gives a ValueError naming the file and the row or column."""
    (data_dir / "philly/runtimes.csv").write_bytes(rows.encode("latin-1"))
    with pytest.raises(ValueError) as err:
        data.philly_runtimes()
    assert "runtimes.csv" in str(err.value) and what in str(err.value), err.value


def test_the_colocation_table_refuses_non_finite_cells_and_reads_a_bom(data_dir):
    """Promise: iadeep/colocation_util.csv with a nan or inf cell is a ValueError naming the row; a
    byte-order mark before its header changes nothing."""
    p = data_dir / "iadeep/colocation_util.csv"
    good = p.read_bytes()
    models, x, y = data.colocation_util(p)
    p.write_bytes(b"\xef\xbb\xbf" + good)
    m2, x2, y2 = data.colocation_util(p)
    assert m2 == models and (x2 == x).all() and (y2 == y).all()
    lines = good.decode().splitlines()
    cells = lines[1].split(",")
    cells[0] = "nan"
    p.write_text("\n".join([lines[0], ",".join(cells)] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match="row 2"):
        data.colocation_util(p)


# --- job spec files -----------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"[1, 2]", b'{"command": ["x"], "cpus": 1e400'])
def test_a_bad_job_spec_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch, content):
    """Promise: `dlshare job submit --spec FILE` with a binary, non-object or broken JSON file exits
    2 with one line naming the file, before anything is sent."""
    monkeypatch.setenv("DLSHARE_SCHED_TOKEN", "t")
    monkeypatch.setenv("DLSHARE_SCHED_URL", "http://127.0.0.1:9")  # nothing listens: nothing is sent
    p = _write(tmp_path, "spec.json", content)
    assert main(["job", "submit", "--spec", str(p)]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "Traceback" not in err, err


def test_the_token_file_must_be_text(tmp_path):
    """Promise: a scheduler token file that is not text is refused with its path, not used."""
    from scheduler.service.store import load_or_create_token

    db = tmp_path / "sched.db"
    (tmp_path / "sched.db.token").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError) as err:
        load_or_create_token(str(db))
    assert "sched.db.token" in str(err.value)
    assert os.path.exists(tmp_path / "sched.db.token")
