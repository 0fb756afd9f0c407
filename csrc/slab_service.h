#ifndef DLSHARE_SLAB_SERVICE_H
#define DLSHARE_SLAB_SERVICE_H
/* The request side of the slab server, internal to it (no .cdef: Python never
 * calls it).  It holds the slab table, makes the checks every request passes
 * (flags, slab, token, bounds, checksums) and dispatches each complete frame to
 * PING, READ or WRITE, appending the response to the connection's output queue.
 * It knows nothing of epoll, accept or timeouts: tcp_server.c owns the sockets,
 * reads bytes into a stream's input buffer and flushes its output. */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "tcp_server.h"
#include "wire.h"

#define DLS_ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_RELAXED)
#define DLS_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

/* Stop parsing a connection's input while this much of its output is queued. */
#define DLS_OUT_HIGH_WATER (8u << 20)

typedef struct dls_slab {
    uint8_t *base;
    uint64_t size;
    uint8_t token[DLS_TOKEN_LEN];
    uint64_t last_access_ns, reads, writes, bytes_read, bytes_written; /* atomics */
} dls_slab;

/* Slabs by id, guarded by a writer-preferring rwlock: requests hold it shared
 * while they copy, removal holds it exclusive. */
typedef struct dls_slab_table {
    pthread_rwlock_t lock;
    dls_slab **slabs; /* DLS_MAX_SLAB_ID entries; NULL until dls_slabs_init */
} dls_slab_table;

/* One connection as the request side sees it.  Touched by its worker only. */
typedef struct dls_stream {
    int fd; /* for the direct send of large READ responses */
    uint8_t *in;
    size_t inlen, incap;
    uint8_t *out;
    size_t outlen, outoff, outcap;
    int closing;            /* close once the output is flushed */
    int authed;             /* some request on it carried a valid token */
    int prechecked;         /* the incomplete WRITE at in[0] passed its early checks */
    uint64_t discard;       /* payload bytes of a refused WRITE still to drop unread */
    uint64_t partial_since; /* when the incomplete frame now pending began; 0: none */
} dls_stream;

/* Grow *buf to at least `need` bytes (doubling); 0, or -ENOMEM. */
int dls_reserve(uint8_t **buf, size_t *cap, size_t need);

/* 0 or -errno (the add, remove and stats calls: as dls_server_add_slab and the others, tcp_server.h). */
int dls_slabs_init(dls_slab_table *t);
void dls_slabs_destroy(dls_slab_table *t);
int dls_slabs_add(dls_slab_table *t, uint32_t id, void *base, uint64_t size, const uint8_t *token);
int dls_slabs_remove(dls_slab_table *t, uint32_t id);
int dls_slabs_stats(dls_slab_table *t, uint32_t id, dls_slab_stats *out);

/* Parse and serve the complete frames buffered on c, counting into n (atomics):
 * requests, errors, bad_frames, and bytes_out for what is sent directly.  Sets
 * c->closing when the stream cannot go on.  Returns 1 when it stopped at the
 * output high-water mark with input left to parse, else 0. */
int dls_serve_input(dls_slab_table *t, dls_server_counters *n, dls_stream *c);
#endif
