#ifndef DLSHARE_PROVIDER_H
#define DLSHARE_PROVIDER_H
/* The transport seam of remote memory.  A provider moves batches of slab
 * segments between a local buffer and a donor.  Callers go through dls_ep_*,
 * which picks the provider by name.  There is one provider: `tcp`
 * (tcp_client.c).  The RDMA verbs provider is not written yet; provider.c's
 * lookup has its place behind DLS_HAVE_VERBS (a build against libibverbs that
 * defines dls_verbs_provider), and until then asking for `verbs` fails with
 * that reason. */
#include <stddef.h>
#include <stdint.h>

/* The calls that move a batch (read, write, ping) return 0, a negative errno for
 * a local failure (DLS_E_IO, DLS_E_TIMEOUT, ... in wire.h are such errnos), or
 * the positive status the donor answered (wire.h: DLS_E_TOKEN, ...). */

/* One batch: nseg segments (offs[i], lens[i]) of slab `slab`, laid out back to
 * back in `buf` (read: filled; write: taken).  With DLS_F_CRC in flags each
 * segment is CRC-32C checked end to end and its CRC stored in crcs[i]. */
/* Client-side only (never sent): store the CRC-32C of each segment in crcs[i],
 * computed here (READ: of what arrived; WRITE: of what is sent) without asking
 * the donor to check anything.  A consumer that keeps the CRC of every page it
 * wrote checks reads against that table, end to end, and the donor spends no
 * CPU on checksums. */
#define DLS_F_LOCAL_CRC 0x100u

typedef struct dls_batch {
    uint32_t slab;
    const uint8_t *token;
    uint32_t nseg;
    const uint64_t *offs;
    const uint32_t *lens;
    uint8_t *buf;
    uint32_t flags;
    uint32_t *crcs;
    int timeout_ms;
    int32_t bad_seg; /* out: the segment whose checksum failed, else -1 */
    uint32_t spin_us; /* a lone request: poll for the answer this long before sleeping in recv (0: sleep) */
} dls_batch;

typedef struct dls_provider {
    const char *name;
    /* The connection in *out; 0, or -errno and the reason in err. */
    int (*connect)(const char *host, int port, int timeout_ms, void **out, char *err, size_t err_len);
    /* Make [base, base+len) usable as a batch buffer (RDMA memory registration;
     * a no-op for tcp).  0 or an error status. */
    int (*register_region)(void *conn, void *base, uint64_t len);
    int (*read_batch)(void *conn, dls_batch *b);
    int (*write_batch)(void *conn, dls_batch *b);
    int (*ping)(void *conn, int timeout_ms);
    void (*close)(void *conn);
    /* Optional: write batch i on conns[i] for every i at once (one wait for them all), status in
     * rcs[i]; a connection may carry several (in order, pipelined).  NULL makes dls_ep_write_many
     * write them one after the other. */
    void (*write_many)(void **conns, dls_batch **bs, int n, int *rcs);
} dls_provider;

extern const dls_provider dls_tcp_provider;
#ifdef DLS_HAVE_VERBS
extern const dls_provider dls_verbs_provider;
#endif

typedef struct dls_ep dls_ep;
/* The endpoint in *out; 0, or -errno and the reason in err: -EOPNOTSUPP when the
 * provider is unknown or not built, another when the donor cannot be reached. */
int dls_ep_connect(const char *provider, const char *host, int port, int timeout_ms, dls_ep **out, char *err,
                   size_t err_len);
int dls_ep_register_region(dls_ep *ep, void *base, uint64_t len);
int dls_ep_read(dls_ep *ep, dls_batch *b);
int dls_ep_write(dls_ep *ep, dls_batch *b);
int dls_ep_ping(dls_ep *ep, int timeout_ms);
/* Batch i on eps[i], all in flight together: the same bytes to several copies, or several slabs'
 * batches, so n batches cost about one round trip instead of n.  An endpoint may appear more than
 * once (its batches go in order, pipelined on its connection); if it breaks, all of its batches
 * fail.  rcs[i]: each batch's status. */
void dls_ep_write_many(dls_ep **eps, dls_batch **bs, int n, int *rcs);
/* One segment, no arrays: the small-read fast path. */
int dls_ep_read1(dls_ep *ep, uint32_t slab, const uint8_t *token, uint64_t off, uint32_t len, uint8_t *buf,
                 uint32_t flags, uint32_t *crc_out, int timeout_ms);
void dls_ep_close(dls_ep *ep);
/* 1 when a provider of that name is compiled in. */
int dls_provider_available(const char *name);
#endif
