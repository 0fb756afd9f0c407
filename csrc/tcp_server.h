#ifndef DLSHARE_TCP_SERVER_H
#define DLSHARE_TCP_SERVER_H
/* The donor's slab server over TCP: epoll worker threads that serve batched
 * READ/WRITE requests on registered slabs, with no Python on the data path.
 * Every request is validated (wire.h) and checked against its slab's token
 * and bounds; a bad one gets an error status, never an access outside a slab. */
#include <stddef.h>
#include <stdint.h>

#define DLS_MAX_SLAB_ID 65536
#define DLS_MAX_CONNECTIONS 4096 /* per server; more are closed on accept */
#define DLS_MAX_PER_PEER 256     /* per peer address (IPv4, or IPv6 address) */
#define DLS_FD_RESERVE 64        /* descriptors left to the rest of the process: connections <= RLIMIT_NOFILE - this */
#define DLS_IDLE_TIMEOUT_MS 60000  /* default: no bytes for this long, never authenticated */
#define DLS_FRAME_TIMEOUT_MS 10000 /* default: an incomplete frame pending this long */

typedef struct dls_server dls_server;

typedef struct dls_slab_stats {
    uint64_t size;
    uint64_t last_access_ns; /* CLOCK_MONOTONIC; 0 if never accessed */
    uint64_t reads, writes, bytes_read, bytes_written;
} dls_slab_stats;

/* refused: connections closed on accept (over a cap, or out of descriptors);
 * refused_per_peer: of those, over the per-address cap; fd_exhausted: accepts
 * that failed for want of a descriptor (EMFILE/ENFILE). */
typedef struct dls_server_counters {
    uint64_t connections, open_connections, requests, errors, bad_frames, bytes_in, bytes_out, refused;
    uint64_t refused_per_peer, fd_exhausted;
} dls_server_counters;

/* Listen on host:port (port 0 picks a free one) with `nthreads` workers, closing
 * connections beyond `max_conns` on accept (0: DLS_MAX_CONNECTIONS; never more
 * than RLIMIT_NOFILE - DLS_FD_RESERVE).  The server in *out; 0, or -errno and
 * the reason in err. */
int dls_server_start(const char *host, int port, int nthreads, int max_conns, dls_server **out, char *err,
                     size_t err_len);
/* The same, with a per-address cap and the timeouts that free places held by
 * idle or stalled peers (dls_server_start uses the defaults above):
 * - max_per_peer: connections from one peer address beyond this are closed on
 *   accept (<= 0: DLS_MAX_PER_PEER);
 * - idle_timeout_ms: a connection that has not sent a request with a valid
 *   token this long after it opened is closed, whatever it sent (a PING needs
 *   no token).  Connections that did are never closed for idling (consumers
 *   keep theirs open between bursts).  <= 0: off;
 * - frame_timeout_ms: a connection with an incomplete request pending for this
 *   long (its first byte arrived that long ago) is closed, whoever it is,
 *   unless it is the server that waits, with responses still unsent; and one
 *   whose queued responses the peer has not read any of for this long is
 *   closed too (a peer that stops reading pins them).  <= 0: off.
 * A WRITE is checked (flags, slab, token, bounds) as soon as its header and
 * descriptors are in; a refused one gets its error status and its payload is
 * dropped as it arrives, unbuffered, so a peer without a valid token never
 * makes the server hold more than a small fixed buffer. */
int dls_server_start_ex(const char *host, int port, int nthreads, int max_conns, int max_per_peer,
                        int64_t idle_timeout_ms, int64_t frame_timeout_ms, dls_server **out, char *err,
                        size_t err_len);
int dls_server_port(const dls_server *s);
/* The connection cap in force (max_conns after the RLIMIT_NOFILE bound). */
int dls_server_max_connections(const dls_server *s);
void dls_server_stop(dls_server *s);
/* Serve [base, base+size) as slab `id` under `token` (16 bytes).  0, -EINVAL (a bad id or range),
 * -EEXIST (the id is in use) or -ENOMEM. */
int dls_server_add_slab(dls_server *s, uint32_t id, void *base, uint64_t size, const uint8_t *token);
/* Stop serving slab `id`; returns once no request touches it any more, so the
 * caller may unmap it.  0, or -ENOENT (no such slab). */
int dls_server_remove_slab(dls_server *s, uint32_t id);
/* 0, or -ENOENT (no such slab). */
int dls_server_slab_stats(dls_server *s, uint32_t id, dls_slab_stats *out);
void dls_server_get_counters(dls_server *s, dls_server_counters *out);
/* Connections closed by the idle or frame timeout. */
uint64_t dls_server_timed_out(dls_server *s);
uint64_t dls_monotonic_ns(void);
#endif
