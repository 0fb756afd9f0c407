"""Tests of remote memory: rdma/ and its C core (csrc/), one file per module, and its donor side.

test_placement, test_control, test_replica, test_buffer, test_wire: pure cores, no network.
test_native_mem, test_tcp_server: the C data plane against real sockets.
test_pager, test_pager_errors: the region engine over slab servers in this process (test_region: donors).
test_remote, test_spill: RemoteMemory end to end, real broker and donor processes.
test_donor_extension, test_reclaim_core: the donor side (nodesvc.daemon.donor, nodesvc.reclaim).
"""
