"""The node's collectors (nodesvc.telemetry): PSI, RDMA devices from sysfs."""

from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc import telemetry

PSI = """some avg10=1.50 avg60=0.25 avg300=0.05 total=123456
full avg10=0.10 avg60=0.00 avg300=0.00 total=789
"""


def test_parse_psi():
    p = telemetry.parse_psi(PSI)
    assert p["some_avg10"] == 1.5 and p["some_total_us"] == 123456 and p["full_total_us"] == 789


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_parse_psi_garbage_raises_value_error_only(text):
    try:
        out = telemetry.parse_psi(text)
    except ValueError:
        return
    assert all(k.startswith(("some_", "full_")) for k in out)


def test_read_psi_missing_file_reports_reason(tmp_path):
    assert "reason" in telemetry.read_psi("memory", root=str(tmp_path))


def test_rdma_devices_from_sysfs_tree(tmp_path):
    none = telemetry.rdma_devices(str(tmp_path / "absent"))
    assert none["devices"] == [] and "does not exist" in none["reason"]
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    got = telemetry.rdma_devices(str(tmp_path / "ib"))
    assert got["devices"][0]["name"] == "mlx5_0"
    assert got["devices"][0]["ports"] == [{"port": "1", "state": "4: ACTIVE", "rate": "100 Gb/sec (4X EDR)"}]
