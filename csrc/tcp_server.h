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

typedef struct dls_server dls_server;

typedef struct dls_slab_stats {
    uint64_t size;
    uint64_t last_access_ns; /* CLOCK_MONOTONIC; 0 if never accessed */
    uint64_t reads, writes, bytes_read, bytes_written;
} dls_slab_stats;

typedef struct dls_server_counters {
    uint64_t connections, open_connections, requests, errors, bad_frames, bytes_in, bytes_out, refused;
} dls_server_counters;

/* Listen on host:port (port 0 picks a free one) with `nthreads` workers, closing
 * connections beyond `max_conns` on accept (0: DLS_MAX_CONNECTIONS). */
dls_server *dls_server_start(const char *host, int port, int nthreads, int max_conns, char *err, size_t err_len);
int dls_server_port(const dls_server *s);
void dls_server_stop(dls_server *s);
/* Serve [base, base+size) as slab `id` under `token` (16 bytes).  0, or an error status. */
int dls_server_add_slab(dls_server *s, uint32_t id, void *base, uint64_t size, const uint8_t *token);
/* Stop serving slab `id`; returns once no request touches it any more, so the
 * caller may unmap it.  0, or DLS_E_NOSLAB. */
int dls_server_remove_slab(dls_server *s, uint32_t id);
int dls_server_slab_stats(dls_server *s, uint32_t id, dls_slab_stats *out);
void dls_server_get_counters(dls_server *s, dls_server_counters *out);
uint64_t dls_monotonic_ns(void);
#endif
