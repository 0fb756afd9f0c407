#ifndef DLSHARE_PAGER_H
#define DLSHARE_PAGER_H
/* The region engine: one anonymous mapping whose pages live on donors.
 *
 * The mapping is registered with userfaultfd (missing and write-protect
 * modes).  A first touch of a unit (a run of pages, `unit` bytes) is a fault
 * that a C fault thread hands to fetch workers; a worker reads the unit from
 * a live copy into its own bounce buffer and installs it with UFFDIO_COPY.
 * Clean units arrive write-protected, so the first write is a second fault
 * that marks the unit dirty.  Eviction threads keep at most `local_bytes`
 * resident, between a high and a low watermark: dirty units are written back
 * to every copy first, then the pages go with MADV_DONTNEED.  Nothing on these
 * paths touches Python.
 *
 * Python sets the copy map up (extent -> copies: endpoint, slab, token, role),
 * updates it when copies move (rebuild, reclaim, failover), reads the events
 * the engine raises (a copy that failed, a unit whose every copy is gone) and
 * closes it.  See pager_core.h for the unit state machine. */
#include <stddef.h>
#include <stdint.h>

#define DLS_PAGER_FIFO 0   /* evict in the order units came in */
#define DLS_PAGER_CLOCK 1  /* second chance: a unit written while clean, or faulted back soon after it left, is kept once more */
#define DLS_PAGER_RANDOM 2

#define DLS_COPY_LIVE 1       /* holds the data: read and written */
#define DLS_COPY_REBUILDING 2 /* being filled: written, never read */
#define DLS_COPY_EVICTING 3   /* its donor wants it back: read only when no live copy answers; written */
#define DLS_PAGER_MAX_COPIES 8
#define DLS_PAGER_MAX_ENDPOINTS 256
#define DLS_PAGER_MAX_UNIT (1u << 20)

#define DLS_EV_COPY_FAILED 1 /* a copy gave an I/O error or bytes that fail the unit's checksum */
#define DLS_EV_UNITS_LOST 2  /* every copy of units [unit, unit+count) is gone: they are poisoned (SIGBUS) */
#define DLS_EV_ENGINE_ERROR 3 /* a system call on units [unit, unit+count) failed: `call` says which, code is -errno */

/* what failed, in a DLS_EV_ENGINE_ERROR event */
#define DLS_CALL_PROTECT 1   /* write-protecting units before a write-back: they stay resident and dirty */
#define DLS_CALL_UNPROTECT 2 /* making a unit writable: it stays dirty, the writer retries on its next fault */
#define DLS_CALL_DROP 3      /* MADV_DONTNEED of evicted units: they stay resident */
#define DLS_CALL_WAKE 4      /* UFFDIO_WAKE of threads waiting on units */
#define DLS_CALL_POISON 5    /* poisoning or unmapping units whose every copy is gone */
#define DLS_CALL_QUEUE 6     /* queueing units for a fetch or for eviction (out of memory) */
#define DLS_CALL_UNMAP 7     /* replacing the mapping with PROT_NONE at close */
#define DLS_CALL_THREAD 8    /* a fetch worker or evictor could not set up (out of memory): it did not run */
#define DLS_CALL_REINSTALL 9 /* putting back a unit moved out for its write-back (a writer waited, or no copy
                              * took it): lost if this fails where no copy took it */

/* unit states, as dls_pager_unit_state reports them */
#define DLS_UNIT_ABSENT 0
#define DLS_UNIT_FETCHING 1
#define DLS_UNIT_CLEAN 2
#define DLS_UNIT_DIRTY 3
#define DLS_UNIT_WRITEBACK 4
#define DLS_UNIT_EVICTING 5
#define DLS_UNIT_LOST 6

typedef struct dls_pager_config {
    uint64_t nbytes;         /* size of the mapping, a multiple of unit */
    uint32_t unit;           /* bytes: a multiple of 4096, at most DLS_PAGER_MAX_UNIT */
    uint64_t local_bytes;    /* resident at most this much (at least 4 units) */
    int policy;              /* DLS_PAGER_FIFO, _CLOCK or _RANDOM */
    int fetch_workers;       /* threads that fetch and install units ahead of faults (streams, prefetch calls) */
    int evict_threads;
    uint64_t prefetch_bytes; /* how far a sequential stream may run ahead; 0 turns prefetch off */
    int io_timeout_ms;
    uint32_t nextents;
    int fault_threads;       /* threads that read faults and fetch what they ask for themselves (0: 2) */
    uint32_t spin_us;        /* a fault thread polls for its donor's answer this long before it sleeps */
    int no_move;             /* 1: dirty victims are write-protected, written back and dropped in place even
                              * where the kernel has UFFDIO_MOVE (0: each is moved out first, one TLB flush
                              * instead of two; see pager_evict.c) */
} dls_pager_config;

typedef struct dls_pager_event {
    int32_t kind;
    uint32_t extent;
    int32_t endpoint; /* COPY_FAILED: the copy */
    uint32_t slab;
    int32_t code;     /* a wire status (wire.h) */
    uint64_t unit;    /* UNITS_LOST, ENGINE_ERROR: the first unit, and how many */
    uint64_t count;
    int32_t call;     /* ENGINE_ERROR: DLS_CALL_* (code is then -errno) */
} dls_pager_event;

typedef struct dls_pager_stats {
    uint64_t faults_missing;     /* first touches (and touches of evicted units) */
    uint64_t faults_wp;          /* first writes to clean units */
    uint64_t faults_stale;       /* faults already resolved when the fault thread read them */
    uint64_t faults_inflight;    /* first touches of units already on their way (a prefetch not there yet) */
    uint64_t fetched_units;      /* units installed with data from a copy */
    uint64_t zero_units;         /* units installed as zeros (never written back: no fetch needed) */
    uint64_t fetch_runs;         /* batched reads */
    uint64_t prefetched_units;   /* units asked for ahead of a fault (sequential streams) */
    uint64_t evicted_clean;
    uint64_t evicted_dirty;
    uint64_t written_back_units; /* by eviction and flush */
    uint64_t writeback_failures; /* units no durable copy took (kept resident) */
    uint64_t failovers;          /* reads served by another copy after one failed */
    uint64_t copy_failures;
    uint64_t units_lost;
    uint64_t bytes_fetched;
    uint64_t bytes_written;
    uint64_t resident_units;
    uint64_t local_units;
    uint64_t budget_waits;       /* fetches that waited for eviction to make room */
    uint64_t over_budget;        /* fetches that gave up waiting and went over local_bytes */
    uint64_t events_dropped;
    uint64_t user_mode_only;     /* 1: the fd was opened with UFFD_USER_MODE_ONLY */
    uint64_t write_protect;      /* 1: write faults are tracked (else every unit counts as dirty) */
    /* where the time goes (nanoseconds, summed over the threads that spent it) */
    uint64_t fault_ns;           /* the fault thread handling messages (not waiting for them) */
    uint64_t fetch_ns;           /* fetch workers in batched reads (the wire and the donor) */
    uint64_t install_ns;         /* mapping fetched units in (UFFDIO_COPY), settling them, waking */
    uint64_t reserve_wait_ns;    /* fetches waiting for eviction to make room */
    uint64_t evict_ns;           /* evictors picking, writing back and dropping units */
    uint64_t demand_runs;        /* batched reads for faults and prefetch calls */
    uint64_t stream_runs;        /* batched reads for sequential streams */
    uint64_t stream_cancelled;   /* units a stream asked for and gave up before a fetch (the reader left it) */
    uint64_t engine_errors;      /* system calls on the mapping that failed (each one a DLS_EV_ENGINE_ERROR event) */
    uint64_t evicted_moved;      /* dirty units moved out of the mapping (UFFDIO_MOVE) for their write-back */
    uint64_t move_evict;         /* 1: dirty victims leave by UFFDIO_MOVE (else write-protected in place) */
    uint64_t writeback_lock_wait_ns; /* write-backs waiting for an extent's io lock (held by a rebuild step
                                      * or another write-back of the extent) */
    uint64_t evictors_idle;      /* 1: every evictor waits for the resident count to pass its high mark
                                  * (none is picking or dropping units), read with the resident count */
    uint64_t rebuild_resident_bytes; /* of a rebuild's bytes, those copied from this process's own memory
                                      * (units it held) instead of read from a surviving copy */
} dls_pager_stats;

typedef struct dls_pager dls_pager;

/* Map and register the region (nothing runs yet) into *out.  0, or -errno and the reason in err. */
int dls_pager_create(const dls_pager_config *cfg, dls_pager **out, char *err, size_t err_len);
void *dls_pager_base(dls_pager *p);
uint64_t dls_pager_size(dls_pager *p);
/* The id of a donor's slab server (the same host:port gives the same id); -EINVAL for a bad address or
 * when the table is full. */
int dls_pager_endpoint(dls_pager *p, const char *host, int port);
/* Define or replace the copies of extent idx: units [first_unit, first_unit+nunits), unit i of it at
 * byte (i * unit) of each copy's slab.  tokens: 16 bytes per copy.  A copy that failed before keeps
 * failing (the same endpoint, slab and token).  Waits for a write-back of the extent in flight. */
int dls_pager_set_extent(dls_pager *p, uint32_t idx, uint64_t first_unit, uint64_t nunits, uint32_t ncopies,
                         const int32_t *eps, const uint32_t *slabs, const uint8_t *tokens, const uint8_t *roles);
/* The engine's copies of extent idx as they are now (at most max): their endpoint, slab, role and
 * whether they failed.  The number of copies, or -EINVAL for a bad extent. */
int dls_pager_extent_copies(dls_pager *p, uint32_t idx, int32_t *eps, uint32_t *slabs, uint8_t *roles,
                            uint8_t *failed, uint32_t max);
/* Testing only: pause this long between mapping fetched units in and settling their states (with
 * streams_only, only in the fetch workers' stream runs). */
void dls_pager_set_install_delay(dls_pager *p, uint32_t us, int streams_only);
/* Start the fault thread, fetch workers and evictors (every extent must be defined).  0, or -errno and
 * the reason in err. */
int dls_pager_start(dls_pager *p, char *err, size_t err_len);
/* Bring units in (write: installed writable and dirty, so the writes that follow take no fault).
 * timeout_ms > 0: wait until they are resident; returns how many are not (lost or still on
 * their way), 0 when all are in; -ESHUTDOWN on a closed pager, -EINVAL for a bad unit. */
int64_t dls_pager_prefetch(dls_pager *p, const uint64_t *units, uint64_t n, int write, int timeout_ms);
/* Write every dirty unit back to every copy (they stay resident, clean).  0, the number of units
 * that no durable copy took, or -ESHUTDOWN / -ENOMEM. */
int64_t dls_pager_flush(dls_pager *p);
/* Copy every unit of extent idx that holds data from a readable copy into the copy (ep, slab,
 * token), which must already be in the extent's map (as REBUILDING: writes reach it meanwhile).
 * bytes_per_s > 0: at most that many bytes a second, paced after each step (outside the write-back
 * lock); 0: as fast as the copies answer.
 * 0, -errno, or the status a donor answered (wire.h). */
int dls_pager_copy_extent(dls_pager *p, uint32_t idx, int32_t ep, uint32_t slab, const uint8_t *token,
                          uint64_t bytes_per_s);
/* Extent idx has no durable copy left (every copy failed or went): what is left of its data is what is
 * resident.  Before an empty new copy joins it (dls_pager_set_extent), units that were not resident are
 * lost now (poisoned, DLS_EV_UNITS_LOST), since a fault must not read the new copy's bytes for them; and
 * every resident unit becomes dirty with no data on any copy, so that its write-back fills the new copy
 * and no read or rebuild asks a copy for it before then.  Waits up to timeout_ms for units on their way
 * (a fetch failing, a drop) to settle.  Returns the resident units kept; -EBUSY while the extent has a
 * durable copy; -EAGAIN when units stayed on their way; DLS_E_ARG, or DLS_E_CLOSED once closing. */
int64_t dls_pager_salvage_extent(dls_pager *p, uint32_t idx, int timeout_ms);
/* 0 and an event, -EAGAIN after timeout_ms, -ESHUTDOWN once the pager is closed and no event is left. */
int dls_pager_next_event(dls_pager *p, dls_pager_event *ev, int timeout_ms);
void dls_pager_get_stats(dls_pager *p, dls_pager_stats *st);
/* DLS_UNIT_*, or -EINVAL for a unit outside the region. */
int dls_pager_unit_state(dls_pager *p, uint64_t unit);
/* How many of units [first, first+n) lost every copy (poisoned). */
uint64_t dls_pager_lost_in(dls_pager *p, uint64_t first, uint64_t n);
/* Stop everything: the range becomes PROT_NONE (its memory is freed; any later touch is SIGSEGV,
 * never another mapping's bytes), threads blocked in a fault are woken into that, the threads end.
 * Calls racing it return at once (-1 or DLS_E_CLOSED).  The address range stays reserved, and the
 * descriptors open, until dls_pager_free. */
void dls_pager_close(dls_pager *p);
/* Close if needed, release the address range and free the pager: no other call may be in flight. */
void dls_pager_free(dls_pager *p);
#endif
