#ifndef DLSHARE_PAGER_CORE_H
#define DLSHARE_PAGER_CORE_H
/* The region engine's shared state (internal: pager*.c only).
 *
 * Unit states and who moves them (every change under the unit's stripe lock):
 *
 *   ABSENT ---fault/prefetch---> FETCHING ---installed---> CLEAN (write-protected) or DIRTY
 *   CLEAN  ---write fault------> DIRTY (unprotected)
 *   DIRTY  ---evictor/flush----> WRITEBACK (write-protected, sent to every copy)
 *   WRITEBACK ---sent----------> EVICTING (evictor) or CLEAN (flush); DIRTY again when a write
 *                                 waits, or when no durable copy took it
 *   CLEAN  ---evictor----------> EVICTING ---MADV_DONTNEED---> ABSENT, or FETCHING at once when a
 *                                 fault arrived meanwhile (only while its extent has a durable copy)
 *   FETCHING ---every copy gone--> LOST (poisoned: touching it is SIGBUS)
 *   salvage of an extent with no durable copy (dls_pager_salvage_extent): ABSENT with data -> LOST,
 *                                 CLEAN with data -> DIRTY, and no resident unit has data on a copy
 *
 * A fault that finds its unit in transit (FETCHING, WRITEBACK, EVICTING) sets UF_WAIT; whoever
 * settles the unit resolves it (the install wakes the range; a write-back that finds a writer
 * waiting unprotects instead of evicting; a drop that finds one fetches again).  A unit is made
 * writable only under its lock, in the same critical section that makes it DIRTY: otherwise an
 * evictor could protect, copy and drop it in between, and a write would land unseen.  Lock order:
 * extent io -> extent map; ring -> unit stripe; slot, queue, event and install mutexes are leaves. */
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "pager.h"
#include "pager_trend.h"
#include "uffd_compat.h"
#include "provider.h"

/* Newer than the Debian 12 kernel headers (Linux 6.4 and 6.6); the running kernel says whether it has them. */
#ifndef UFFD_FEATURE_POISON
#define UFFD_FEATURE_POISON (1 << 14)
struct uffdio_poison {
    struct uffdio_range range;
    __u64 mode;
    __s64 updated;
};
#define UFFDIO_POISON _IOWR(UFFDIO, 0x08, struct uffdio_poison)
#endif
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

enum { U_ABSENT = DLS_UNIT_ABSENT, U_FETCHING = DLS_UNIT_FETCHING, U_CLEAN = DLS_UNIT_CLEAN,
       U_DIRTY = DLS_UNIT_DIRTY, U_WRITEBACK = DLS_UNIT_WRITEBACK, U_EVICTING = DLS_UNIT_EVICTING,
       U_LOST = DLS_UNIT_LOST };

#define UF_HAS_DATA 0x01 /* its copies hold written-back data (else the unit is zeros: no fetch) */
#define UF_WAIT 0x02     /* a fault arrived while the unit was in transit */
#define UF_WRITE 0x04    /* install it writable: a write is waiting, or a caller will write */
#define UF_QUEUED 0x08   /* in the demand queue */
#define UF_CLAIMED 0x10  /* a worker is fetching it */
#define UF_INRING 0x20   /* in the eviction ring (or the stream queues) */
#define UF_STREAM 0x40   /* installed by a stream's prefetch: evicted first, most recently read first */

#define PG_STRIPES 256
#define PG_MAX_RUN_BYTES (1u << 20) /* one batched fetch or write-back */
/* A stream's units are fetched in runs this big: the first ones are mapped in (and the reader goes on)
 * while the fetch workers bring the next, instead of the reader waiting for a whole 1 MiB run. */
#define PG_STREAM_RUN_BYTES (128u << 10)
#define PG_EV_CAP 1024
#define PG_TRENDS 8 /* sequential detectors, one per faulting thread (LRU) */
#define PG_MAX_FAULT_THREADS 16

typedef struct pg_copy {
    int32_t ep;
    uint32_t slab;
    uint8_t token[16];
    uint8_t role;
    uint8_t failed;
} pg_copy;

typedef struct pg_extent {
    uint64_t first_unit, nunits;
    pthread_mutex_t io;  /* held across one write-back or rebuild step of this extent */
    pthread_mutex_t map; /* guards ncopies/copies */
    uint32_t ncopies;
    pg_copy copies[DLS_PAGER_MAX_COPIES];
    uint32_t durable; /* copies a unit can be read back from (LIVE or EVICTING, not failed); written under
                       * map, read without it: an evictor drops a clean unit only while this is not 0 */
    int defined;
} pg_extent;

typedef struct pg_endpoint {
    char host[256];
    int port;
} pg_endpoint;

/* One thread's connections and buffers (a fetch worker, an evictor, a flush or rebuild call). */
typedef struct pg_io {
    dls_ep *conn[DLS_PAGER_MAX_ENDPOINTS];
    uint8_t *bounce;
    uint64_t *offs;
    uint32_t *lens;
    uint32_t *crcs;
    uint64_t *units;
    uint32_t max_units; /* per run */
    uint32_t spin_us;   /* poll this long for a donor's answer before sleeping (fault threads) */
} pg_io;

typedef struct pg_queue {
    uint32_t *items;
    uint64_t cap, head, len;
} pg_queue;

#define PG_STAT(p, field) (((uint64_t *)&(p)->stats)[offsetof(dls_pager_stats, field) / sizeof(uint64_t)])
#define PG_ADD(p, field, n) __atomic_add_fetch(&PG_STAT(p, field), (uint64_t)(n), __ATOMIC_RELAXED)

static inline uint64_t pg_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct dls_pager {
    dls_pager_config cfg;
    uint8_t *base;
    uint64_t size, unit, nunits;
    uint64_t local_units, hi, lo; /* budget and watermarks, in units */
    int uffd, wakefd;
    int wp, poison, user_mode_only;
    int move; /* dirty victims leave by UFFDIO_MOVE (pager_evict.c); cleared if the kernel refuses one */
    uint32_t zero_crc;
    uint8_t *zeros; /* one unit of zeros, for never-written units */

    uint8_t *state, *flags, *ref;
    uint32_t *crc;       /* CRC-32C of each unit as last written back */
    uint32_t *evict_seq; /* eviction clock (mod 2^32) when the unit last left, 0 never: 13 bytes a unit in all */
    pthread_mutex_t stripe[PG_STRIPES];

    pg_extent *ext;
    uint32_t next;
    pg_endpoint eps[DLS_PAGER_MAX_ENDPOINTS];
    int neps;
    pthread_mutex_t ep_mu;

    pthread_mutex_t q_mu; /* demand and prefetch queues */
    pthread_cond_t q_cv;
    pg_queue demand, pref;

    pthread_mutex_t slot_mu; /* residency */
    pthread_cond_t slot_cv, evict_cv;
    uint64_t resident; /* installed, or reserved for an install in flight */
    int evict_now;

    pthread_mutex_t ring_mu; /* eviction candidates */
    pg_queue ring;
    /* Units a stream brought in: the newest wait in `young` (the reader may not have reached them),
     * then move to the top of the `spent` stack, which eviction takes from the top: most recently
     * read first.  A reader that scans more than fits evicts what it has just read, not what an
     * earlier pass left resident (LRU would evict exactly the units the scan needs next). */
    pg_queue young;
    uint32_t *spent;
    uint64_t spent_len, spent_cap, young_max;
    uint32_t evict_clock;
    uint64_t rng;

    pthread_mutex_t inst_mu; /* prefetch waiters */
    pthread_cond_t inst_cv;
    int inst_waiters; /* wakes are sent only when someone waits: each one is a context switch */
    int slot_waiters, evictors_asleep; /* under slot_mu */

    pthread_mutex_t ev_mu;
    pthread_cond_t ev_cv;
    dls_pager_event ev[PG_EV_CAP];
    uint32_t ev_head, ev_len;

    dls_trend trends[PG_TRENDS]; /* under trend_mu */
    uint32_t trend_tid[PG_TRENDS];
    uint64_t trend_used[PG_TRENDS];
    uint64_t trend_seq;

    pthread_mutex_t trend_mu; /* the sequential detectors, shared by the fault threads */
    pthread_t *faulters, *workers, *evictors;
    struct pg_faulter *faulter_ctx;
    int nfaulters, nworkers, nevictors;
    int started, closed;
    volatile int closing;
    int mem_readers; /* rebuild steps copying units out of the mapping: close waits for them (atomics) */
    uint32_t install_delay_us; /* testing only (dls_pager_set_install_delay) */
    int delay_streams_only;
    dls_pager_stats stats;
};

/* pager_core.c: locks, events, the copy map (the queues: pager_queue.h) */
static inline pthread_mutex_t *pg_lock_of(dls_pager *p, uint64_t u) { return &p->stripe[u % PG_STRIPES]; }
static inline void pg_lock(dls_pager *p, uint64_t u) { pthread_mutex_lock(pg_lock_of(p, u)); }
static inline void pg_unlock(dls_pager *p, uint64_t u) { pthread_mutex_unlock(pg_lock_of(p, u)); }
static inline uint8_t *pg_addr(dls_pager *p, uint64_t u) { return p->base + u * p->unit; }

pg_extent *pg_extent_of(dls_pager *p, uint64_t u, uint32_t *idx);
/* The extent's copies at this moment. */
uint32_t pg_copies(pg_extent *e, pg_copy *out);
/* Under e->map, after its copies changed: count the durable ones again. */
void pg_count_durable_locked(pg_extent *e);
/* A copy failed: mark it (if it is still in the map) and tell Python, once. */
void pg_copy_failed(dls_pager *p, uint32_t idx, const pg_copy *c, int code);
void pg_event(dls_pager *p, const dls_pager_event *ev);

pg_io *pg_io_new(dls_pager *p);
void pg_io_free(pg_io *io);
/* The connection of this io to endpoint ep, opened on first use; NULL when it cannot connect. */
dls_ep *pg_io_conn(dls_pager *p, pg_io *io, int32_t ep);
void pg_io_drop(pg_io *io, int32_t ep);

/* Reserve n resident slots, waiting for eviction (and going over budget after a while). */
void pg_reserve(dls_pager *p, uint64_t n);
void pg_release(dls_pager *p, uint64_t n);

/* Wake the threads waiting in dls_pager_prefetch for units to arrive, if there are any. */
void pg_installed(dls_pager *p);

/* A system call on units [u, u+n) failed with -errno err: count it and raise DLS_EV_ENGINE_ERROR. */
void pg_fail(dls_pager *p, int call, int err, uint64_t u, uint64_t n);

/* uffd helpers: 0 or -errno */
int pg_protect(dls_pager *p, uint64_t u, uint64_t n, int on);
int pg_wake(dls_pager *p, uint8_t *addr, uint64_t len);
/* pg_wake of units [u, u+n), a failure reported (pg_fail). */
void pg_wake_units(dls_pager *p, uint64_t u, uint64_t n);
/* Unit u (DIRTY, under its lock) becomes writable, which wakes its writer.  On failure it is reported
 * and the writer woken anyway: its write faults again, and that fault retries (a write fault on a DIRTY
 * unit unprotects it).  0 or -errno. */
int pg_make_writable(dls_pager *p, uint64_t u);
/* Every copy of units [u, u+n) is gone: poison them (SIGBUS on touch) and say so. */
void pg_lose(dls_pager *p, uint32_t idx, uint64_t u, uint64_t n, int code);

/* pager_io.c: reads and writes against the copies */
/* Read units[0..n) (sorted, one extent, at most io->max_units) back to back into io->bounce from a
 * readable copy, in one batched request, failing over; 0, or DLS_E_IO when no copy could serve them
 * (the units are lost). */
int pg_fetch(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n);
/* Write sorted units (of any extents) back to every copy of their extent, their bytes read from the
 * mapping (write-protected by the caller) or, with `from`, from there, back to back.  Every extent and
 * copy is in flight at once (one round trip for the lot, not one per extent).  ok[i]: 1 when a
 * durable (live or evicting) copy took unit i. */
void pg_write_back(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n, uint8_t *from, uint8_t *ok);
int pg_copy_extent(dls_pager *p, uint32_t idx, int32_t ep, uint32_t slab, const uint8_t *token,
                   uint64_t bytes_per_s);

/* pager_fault.c */
/* A fault thread's own epoll set (the userfaultfd with EPOLLEXCLUSIVE, and the wake-up descriptor)
 * and connections, made before the thread starts so that a failure fails dls_pager_start. */
typedef struct pg_faulter {
    dls_pager *p;
    pg_io *io;
    int ep;
} pg_faulter;
int pg_faulter_init(dls_pager *p, pg_faulter *f);
void pg_faulter_free(pg_faulter *f);
void *pg_fault_main(void *arg); /* arg: a pg_faulter */
void *pg_worker_main(void *arg);

/* pager_evict.c */
void *pg_evict_main(void *arg);
int64_t pg_flush(dls_pager *p);
#endif
