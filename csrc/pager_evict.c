/* The region engine's eviction: resident units wait in a ring in the order they came in; an
 * evictor thread wakes above the high watermark and evicts down to the low one, a batch at a
 * time.  FIFO takes the ring's head; CLOCK gives a unit with its reference count up (written
 * while clean, or faulted back soon after it left) another turn instead; RANDOM picks anywhere.
 * Clean victims are dropped at once (MADV_DONTNEED).  Dirty victims must reach every copy with no
 * write lost on the way.  Where the kernel has UFFDIO_MOVE (Linux 6.8+), each one's page is moved out
 * of the mapping into the evictor's staging run (a touch meanwhile faults and waits), written back from
 * there, and the staging run is dropped once for the whole batch: one TLB flush a unit.  Elsewhere each
 * is write-protected, written back and dropped in place: two flushes a unit, and with the program's
 * threads on several CPUs each flush is an interrupt to the others that the caller waits on (in a VM,
 * 10-15 us).  flush() writes dirty units back in place. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>

#include "pager_core.h"
#include "pager_queue.h"
#include "wire.h"

/* Under ring_mu: a stream's units older than its young window move to the top of the spent stack. */
static void age_streams(dls_pager *p) {
    uint32_t u;
    while (p->young.len > p->young_max && pg_queue_pop(&p->young, &u) == 0) {
        if (p->spent_len == p->spent_cap) {
            uint32_t *grown = realloc(p->spent, 2 * p->spent_cap * sizeof *grown);
            if (!grown) { /* keep it evictable the ordinary way */
                pg_ring_push_locked(p, u);
                continue;
            }
            p->spent = grown;
            p->spent_cap *= 2;
        }
        p->spent[p->spent_len++] = u;
    }
}

static uint64_t next_rand(dls_pager *p) { /* xorshift64: the victim choice of RANDOM, under ring_mu */
    uint64_t x = p->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return p->rng = x;
}

/* A clean unit is dropped only while its extent has a copy to read it back from (or when it holds
 * no data: it comes back as zeros).  When every copy is gone its resident bytes are the last of its
 * data: it stays, as a dirty unit that no copy took does, and touching it never faults.  Under the
 * unit's lock. */
static int droppable(dls_pager *p, uint64_t u) {
    return !(p->flags[u] & UF_HAS_DATA) || __atomic_load_n(&pg_extent_of(p, u, NULL)->durable, __ATOMIC_ACQUIRE) != 0;
}

/* Up to max victims, moved to EVICTING (clean) or WRITEBACK (dirty) under their locks. */
static uint32_t pick(dls_pager *p, uint64_t *out, uint8_t *dirty, uint32_t max) {
    uint32_t n = 0;
    pthread_mutex_lock(&p->ring_mu);
    age_streams(p);
    while (n < max && p->spent_len) { /* spent stream units first, the most recently read on top */
        uint32_t u = p->spent[--p->spent_len];
        pg_lock(p, u);
        uint8_t s = p->state[u];
        int keep = 0;
        if (s == U_WRITEBACK || (s == U_CLEAN && !droppable(p, u))) {
            keep = 1; /* a flush is writing it back, or it is its data's last copy: still resident */
        } else if (s != U_CLEAN && s != U_DIRTY) {
            p->flags[u] &= (uint8_t)~(UF_INRING | UF_STREAM);
        } else {
            p->flags[u] &= (uint8_t)~(UF_INRING | UF_STREAM);
            p->state[u] = s == U_CLEAN ? U_EVICTING : U_WRITEBACK;
            dirty[n] = s == U_DIRTY;
            out[n++] = u;
        }
        pg_unlock(p, u);
        if (keep) pg_ring_push_locked(p, u);
    }
    uint64_t budget = 2 * p->ring.len + 16; /* CLOCK may pass every unit once before taking one */
    while (n < max && p->ring.len && budget--) {
        if (p->cfg.policy == DLS_PAGER_RANDOM && p->ring.len > 1) {
            uint64_t k = next_rand(p) % p->ring.len;
            uint64_t a = p->ring.head, b = (p->ring.head + k) % p->ring.cap;
            uint32_t t = p->ring.items[a];
            p->ring.items[a] = p->ring.items[b];
            p->ring.items[b] = t;
        }
        uint32_t u;
        pg_queue_pop(&p->ring, &u);
        pg_lock(p, u);
        uint8_t s = p->state[u];
        int back = 0;
        if (s == U_WRITEBACK || (s == U_CLEAN && !droppable(p, u))) {
            back = 1; /* a flush is writing it back, or it is its data's last copy: still resident */
        } else if (s != U_CLEAN && s != U_DIRTY) {
            p->flags[u] &= (uint8_t)~UF_INRING;
        } else if (p->cfg.policy == DLS_PAGER_CLOCK && p->ref[u]) {
            p->ref[u]--;
            back = 1;
        } else {
            p->flags[u] &= (uint8_t)~UF_INRING;
            p->state[u] = s == U_CLEAN ? U_EVICTING : U_WRITEBACK;
            dirty[n] = s == U_DIRTY;
            out[n++] = u;
        }
        pg_unlock(p, u);
        if (back) pg_queue_push(&p->ring, u); /* just popped from it: there is room */
    }
    pthread_mutex_unlock(&p->ring_mu);
    return n;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void write_back_sorted(dls_pager *p, pg_io *io, uint64_t *units, uint32_t n, uint8_t *ok, uint8_t *from) {
    pg_write_back(p, io, units, n, from, ok);
    uint32_t failed = 0;
    for (uint32_t i = 0; i < n; i++) failed += !ok[i];
    if (failed) PG_ADD(p, writeback_failures, failed);
}

/* A written-back unit that a writer is waiting on stays, dirty again; one no copy took stays too. */
static int keep_if_wanted(dls_pager *p, uint64_t u, int written) {
    pg_lock(p, u);
    int keep = !written || (p->flags[u] & UF_WAIT);
    if (keep) {
        p->state[u] = U_DIRTY;
        p->flags[u] &= (uint8_t)~UF_WAIT;
        pg_make_writable(p, u); /* wakes the writer; under the lock, like every unprotect */
    } else {
        p->state[u] = U_EVICTING;
    }
    pg_unlock(p, u);
    if (keep) pg_ring_add(p, u);
    return keep;
}

/* After MADV_DONTNEED: ABSENT, or straight back to FETCHING when a fault came while it went. */
static void settle_dropped(dls_pager *p, uint64_t u, int was_dirty) {
    int refetch = 0;
    pg_lock(p, u);
    uint32_t seq = __atomic_add_fetch(&p->evict_clock, 1, __ATOMIC_RELAXED);
    p->evict_seq[u] = seq ? seq : 1;
    p->flags[u] &= (uint8_t)~UF_STREAM;
    if (p->flags[u] & UF_WAIT) { /* touched while it went: bring it back for the waiter */
        p->state[u] = U_FETCHING;
        p->flags[u] = (uint8_t)((p->flags[u] & ~UF_WAIT) | UF_QUEUED);
        refetch = 1;
    } else {
        p->state[u] = U_ABSENT;
    }
    pg_unlock(p, u);
    if (was_dirty) PG_ADD(p, evicted_dirty, 1);
    else PG_ADD(p, evicted_clean, 1);
    if (refetch) pg_queue_demand(p, u);
}

/* MADV_DONTNEED failed: the units' pages (written back, or clean, and write-protected) are still
 * there, so they stay resident as they are; a fault that came meanwhile finds them on its retry. */
static void keep_undropped(dls_pager *p, const uint64_t *units, uint32_t n, int err) {
    pg_fail(p, DLS_CALL_DROP, err, units[0], n);
    for (uint32_t i = 0; i < n; i++) {
        pg_lock(p, units[i]);
        p->state[units[i]] = p->wp ? U_CLEAN : U_DIRTY; /* without write-protect every unit counts as dirty */
        p->flags[units[i]] &= (uint8_t)~(UF_WAIT | UF_WRITE);
        pg_unlock(p, units[i]);
        pg_ring_add(p, units[i]);
    }
    pg_wake_units(p, units[0], n);
}

/* Drop sorted units (all EVICTING): one MADV_DONTNEED per run of adjacent units, and one release of
 * their slots for the whole batch (each release wakes every fetch waiting for room).  Returns how many
 * stayed because MADV_DONTNEED failed. */
static uint32_t drop_sorted(dls_pager *p, const uint64_t *units, const uint8_t *was_dirty, uint32_t n) {
    uint32_t dropped = 0;
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        while (j < n && units[j] == units[j - 1] + 1) j++;
        if (madvise(pg_addr(p, units[i]), (size_t)(j - i) * p->unit, MADV_DONTNEED) != 0) {
            keep_undropped(p, units + i, j - i, -errno);
        } else {
            for (uint32_t k = i; k < j; k++) settle_dropped(p, units[k], was_dirty[k]);
            dropped += j - i;
        }
        i = j;
    }
    if (dropped) pg_release(p, dropped);
    return n - dropped;
}

/* A unit that could not be write-protected for its write-back stays dirty and resident (a write
 * could land while it is copied).  Under its lock, like every unprotect. */
static void back_to_dirty(dls_pager *p, uint64_t u) {
    pg_lock(p, u);
    p->state[u] = U_DIRTY;
    if (p->flags[u] & UF_WAIT) {
        p->flags[u] &= (uint8_t)~UF_WAIT;
        pg_make_writable(p, u);
    }
    pg_unlock(p, u);
}

/* Write-protect sorted units, one ioctl per run of adjacent units.  The units of a run that failed
 * go back to DIRTY and out of the list; returns how many are left, in order. */
static uint32_t protect_sorted(dls_pager *p, uint64_t *units, uint32_t n) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        while (j < n && units[j] == units[j - 1] + 1) j++;
        int rc = pg_protect(p, units[i], j - i, 1);
        if (rc) {
            pg_fail(p, DLS_CALL_PROTECT, rc, units[i], j - i);
            for (uint32_t k = i; k < j; k++) {
                back_to_dirty(p, units[k]);
                pg_ring_add(p, units[k]); /* evictable later (a flush's units are in the ring already) */
            }
            PG_ADD(p, writeback_failures, j - i);
        } else {
            for (uint32_t k = i; k < j; k++) units[kept++] = units[k];
        }
        i = j;
    }
    return kept;
}

/* No more moves for this region (the old path is always right); stats say so. */
static void stop_moving(dls_pager *p) {
    __atomic_store_n(&p->move, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&PG_STAT(p, move_evict), 0, __ATOMIC_RELAXED);
}

/* UFFDIO_COPY of len bytes from `from` into holes at `to` in a registered range, writable, nobody woken.
 * 0 or -errno. */
static int copy_in(dls_pager *p, uint8_t *to, uint8_t *from, uint64_t len) {
    struct uffdio_copy c = {.dst = (uintptr_t)to, .src = (uintptr_t)from, .len = len, .mode = UFFDIO_COPY_MODE_DONTWAKE};
    for (;;) {
        c.copy = 0;
        if (ioctl(p->uffd, UFFDIO_COPY, &c) == 0) return 0;
        int e = errno;
        if (c.copy > 0) { /* part of it is in */
            c.dst += (uint64_t)c.copy;
            c.src += (uint64_t)c.copy;
            c.len -= (uint64_t)c.copy;
            continue;
        }
        if (e != EAGAIN && e != EINTR) return -e;
    }
}

/* Move unit u's pages (DIRTY, being written back) to `to`, holes of the staging run.  0, or -errno with
 * the unit where it was (a page shared or pinned: EBUSY; no page: ENOENT): pages of a multi-page unit
 * that had gone are put back. */
static int move_out(dls_pager *p, uint64_t u, uint8_t *to) {
    uint8_t *from = pg_addr(p, u);
    uint64_t done = 0;
    while (done < p->unit) {
        struct uffdio_move m = {.dst = (uintptr_t)(to + done), .src = (uintptr_t)(from + done),
                                .len = p->unit - done, .mode = UFFDIO_MOVE_MODE_DONTWAKE};
        if (ioctl(p->uffd, UFFDIO_MOVE, &m) == 0) return 0;
        int e = errno;
        if (m.move > 0) {
            done += (uint64_t)m.move;
            continue;
        }
        if (e == EAGAIN || e == EINTR) continue;
        if (done) {
            int rc = copy_in(p, from, to, done);
            /* neither should fail (a copy into holes just made, a drop of our own run); if one did, moves
             * stop, and a unit left with holes would fault on the evictor's own copy: it is reported */
            if (madvise(to, done, MADV_DONTNEED) != 0 || rc) {
                stop_moving(p);
                if (rc) pg_fail(p, DLS_CALL_REINSTALL, rc, u, 1);
            }
        }
        return -e;
    }
    return 0;
}

/* Dirty victims (sorted, WRITEBACK) that `move_out` took out to stage[0..n): written back from there;
 * those a writer waits for, or that no copy took, go back in (dirty), the rest are gone.  The staging
 * run is then dropped in one call.  Returns how many units left the mapping. */
static uint32_t evict_moved(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n, uint8_t *stage) {
    uint8_t ok[256];
    write_back_sorted(p, io, (uint64_t *)units, n, ok, stage);
    uint32_t gone = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t u = units[i];
        pg_lock(p, u);
        int keep = !ok[i] || (p->flags[u] & UF_WAIT);
        pg_unlock(p, u);
        if (!keep) { /* a touch from now on faults as missing and fetches it (settle_dropped) */
            settle_dropped(p, u, 1);
            gone++;
            continue;
        }
        int rc = copy_in(p, pg_addr(p, u), stage + (size_t)i * p->unit, p->unit);
        pg_lock(p, u);
        p->flags[u] &= (uint8_t)~UF_WAIT;
        if (rc == 0) p->state[u] = U_DIRTY;
        pg_unlock(p, u);
        if (rc == 0) {
            pg_wake_units(p, u, 1);
            pg_ring_add(p, u);
            continue;
        }
        pg_fail(p, DLS_CALL_REINSTALL, rc, u, 1);
        if (ok[i]) { /* its copies have these bytes: it is simply evicted, and a touch fetches it */
            settle_dropped(p, u, 1);
            gone++;
        } else { /* no copy took it and it cannot go back: say so rather than read zeros later */
            uint32_t idx;
            pg_extent_of(p, u, &idx);
            pg_lose(p, idx, u, 1, DLS_E_IO);
        }
    }
    if (madvise(stage, (size_t)n * p->unit, MADV_DONTNEED) != 0) { /* the run is not empty: no more moves */
        pg_fail(p, DLS_CALL_DROP, -errno, units[0], n);
        stop_moving(p);
    }
    if (gone) pg_release(p, gone);
    PG_ADD(p, evicted_moved, gone);
    return gone;
}

/* Returns how many victims could not be dropped (MADV_DONTNEED failed).  `stage`: the evictor's
 * staging run (at least n units), or NULL to write dirty victims back in place. */
static uint32_t evict_batch(dls_pager *p, pg_io *io, uint64_t *victims, uint8_t *dirty, uint32_t n, uint8_t *stage) {
    uint64_t wb[256], gone[256], moved[256];
    uint8_t ok[256], gone_dirty[256];
    uint32_t nw = 0, ng = 0, nm = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (dirty[i]) {
            wb[nw++] = victims[i];
        } else {
            gone_dirty[ng] = 0;
            gone[ng++] = victims[i];
        }
    }
    if (nw && stage && __atomic_load_n(&p->move, __ATOMIC_RELAXED)) {
        qsort(wb, nw, sizeof *wb, cmp_u64);
        uint32_t left = 0;
        for (uint32_t i = 0; i < nw; i++) {
            int rc = move_out(p, wb[i], stage + (size_t)nm * p->unit);
            if (rc == 0) {
                moved[nm++] = wb[i];
                continue;
            }
            if (rc == -EINVAL || rc == -ENOTTY || rc == -ENOSYS) stop_moving(p); /* this kernel or mapping refuses */
            wb[left++] = wb[i]; /* written back in place, below */
        }
        nw = left;
        if (nm) evict_moved(p, io, moved, nm, stage);
    }
    if (nw) {
        qsort(wb, nw, sizeof *wb, cmp_u64);
        nw = protect_sorted(p, wb, nw); /* from here on a write faults */
        write_back_sorted(p, io, wb, nw, ok, NULL);
        for (uint32_t i = 0; i < nw; i++)
            if (!keep_if_wanted(p, wb[i], ok[i])) {
                gone_dirty[ng] = 1;
                gone[ng++] = wb[i];
            }
    }
    /* sort what goes, carrying its dirty mark along */
    for (uint32_t i = 1; i < ng; i++)
        for (uint32_t j = i; j > 0 && gone[j - 1] > gone[j]; j--) {
            uint64_t t = gone[j];
            gone[j] = gone[j - 1];
            gone[j - 1] = t;
            uint8_t d = gone_dirty[j];
            gone_dirty[j] = gone_dirty[j - 1];
            gone_dirty[j - 1] = d;
        }
    return drop_sorted(p, gone, gone_dirty, ng);
}

/* An evictor's staging run: n units of anonymous memory registered with the region's userfaultfd (a
 * move's destination must be) with the mapping's own settings; only ever read where a move put a page.
 * NULL if it cannot be had (dirty victims are then written back in place). */
static uint8_t *staging_run(dls_pager *p, uint32_t n) {
    size_t len = (size_t)n * p->unit;
    uint8_t *s = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) return NULL;
    struct uffdio_register reg = {.range = {.start = (uintptr_t)s, .len = len},
                                  .mode = UFFDIO_REGISTER_MODE_MISSING | (p->wp ? UFFDIO_REGISTER_MODE_WP : 0)};
    if (madvise(s, len, MADV_DONTFORK) != 0 || (madvise(s, len, MADV_NOHUGEPAGE) != 0 && errno != EINVAL) ||
        ioctl(p->uffd, UFFDIO_REGISTER, &reg) != 0 || !(reg.ioctls & (1ull << _UFFDIO_MOVE))) {
        munmap(s, len);
        return NULL;
    }
    return s;
}

void *pg_evict_main(void *arg) {
    dls_pager *p = arg;
    pg_io *io = pg_io_new(p);
    if (!io) {
        pg_fail(p, DLS_CALL_THREAD, -ENOMEM, 0, 0);
        return NULL;
    }
    uint32_t batch = io->max_units > 256 ? 256 : io->max_units;
    if (batch > 64) batch = 64;
    uint64_t victims[256];
    uint8_t dirty[256];
    uint8_t *stage = p->move ? staging_run(p, batch) : NULL;
    for (;;) {
        pthread_mutex_lock(&p->slot_mu);
        while (!p->closing && p->resident <= p->hi && !p->evict_now) {
            p->evictors_asleep++;
            pthread_cond_wait(&p->evict_cv, &p->slot_mu);
            p->evictors_asleep--;
        }
        int forced = p->evict_now;
        p->evict_now = 0;
        pthread_mutex_unlock(&p->slot_mu);
        if (p->closing) break;
        for (;;) {
            pthread_mutex_lock(&p->slot_mu);
            uint64_t need = p->resident > p->lo ? p->resident - p->lo : (uint64_t)forced;
            pthread_mutex_unlock(&p->slot_mu);
            forced = 0;
            if (!need || p->closing) break;
            uint32_t n = pick(p, victims, dirty, need < batch ? (uint32_t)need : batch);
            if (!n) { /* everything resident is in transit: let it settle */
                struct timespec ts = {0, 2 * 1000000L};
                nanosleep(&ts, NULL);
                break;
            }
            uint64_t t0 = pg_now_ns();
            uint32_t stuck = evict_batch(p, io, victims, dirty, n, stage);
            PG_ADD(p, evict_ns, pg_now_ns() - t0);
            if (stuck) { /* the kernel refuses to drop pages (reported): try again later, not in a loop */
                struct timespec ts = {0, 50 * 1000000L};
                nanosleep(&ts, NULL);
                break;
            }
        }
    }
    if (stage) munmap(stage, (size_t)batch * p->unit);
    pg_io_free(io);
    return NULL;
}

int64_t pg_flush(dls_pager *p) {
    pg_io *io = pg_io_new(p);
    if (!io) return -ENOMEM;
    uint32_t batch = io->max_units > 256 ? 256 : io->max_units;
    uint64_t units[256];
    uint8_t ok[256];
    int64_t failed = 0;
    for (uint32_t x = 0; x < p->next && !p->closing; x++) {
        pg_extent *e = &p->ext[x];
        uint64_t end = e->first_unit + e->nunits;
        for (uint64_t u = e->first_unit; u < end && !p->closing;) {
            uint32_t n = 0;
            for (; u < end && n < batch; u++) {
                pg_lock(p, u);
                if (p->state[u] == U_DIRTY) {
                    p->state[u] = U_WRITEBACK;
                    units[n++] = u;
                }
                pg_unlock(p, u);
            }
            if (!n) continue;
            uint32_t all = n;
            n = protect_sorted(p, units, n);
            failed += all - n;
            write_back_sorted(p, io, units, n, ok, NULL);
            for (uint32_t i = 0; i < n; i++) {
                uint64_t v = units[i];
                pg_lock(p, v);
                if (!ok[i] || (p->flags[v] & UF_WAIT)) {
                    p->state[v] = U_DIRTY;
                    p->flags[v] &= (uint8_t)~UF_WAIT;
                    pg_make_writable(p, v);
                } else {
                    p->state[v] = U_CLEAN;
                }
                pg_unlock(p, v);
                failed += !ok[i];
            }
        }
    }
    pg_io_free(io);
    return failed;
}
