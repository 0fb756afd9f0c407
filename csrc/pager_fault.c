/* The region engine's fault path: the fault thread reads userfaultfd messages and moves units
 * (pager_core.h has the states); fetch workers read units from a copy into their bounce
 * buffers and install them with UFFDIO_COPY.  Sequential streams (pager_trend.h) are fetched
 * ahead of their faults, one detector per faulting thread. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "pager_core.h"
#include "pager_queue.h"
#include "wire.h"

#define PAGE 4096u

static dls_trend *trend_for(dls_pager *p, uint32_t tid, uint64_t stamp) {
    int oldest = 0;
    for (int i = 0; i < PG_TRENDS; i++) {
        if (p->trend_used[i] && p->trend_tid[i] == tid) {
            p->trend_used[i] = stamp;
            return &p->trends[i];
        }
        if (p->trend_used[i] < p->trend_used[oldest]) oldest = i;
    }
    dls_trend_init(&p->trends[oldest]);
    p->trend_tid[oldest] = tid;
    p->trend_used[oldest] = stamp;
    return &p->trends[oldest];
}

/* Queue units first, first+stride, ... that are absent.  At most a quarter of the budget is asked
 * for ahead at once: a prefetch displaces resident units (the workers reserve room as for a fault),
 * and a stream must not flush the whole cache. */
static uint32_t prefetch(dls_pager *p, int64_t first, int64_t stride, uint32_t count, int write) {
    uint32_t picked[256];
    uint32_t k = 0;
    uint64_t cap = p->local_units / 4 > 2 ? p->local_units / 4 : 2;
    pthread_mutex_lock(&p->q_mu);
    uint64_t queued = p->pref.len;
    pthread_mutex_unlock(&p->q_mu);
    uint64_t room = cap > queued ? cap - queued : 0;
    if (count > room) count = (uint32_t)room;
    if (count > 256) count = 256;
    uint32_t covered = 0;
    for (uint32_t i = 0; i < count; i++, covered++) {
        int64_t v = first + stride * (int64_t)i;
        if (v < 0 || (uint64_t)v >= p->nunits) break;
        pg_lock(p, (uint64_t)v);
        if (p->state[v] == U_ABSENT) {
            p->state[v] = U_FETCHING;
            if (write) p->flags[v] |= UF_WRITE; /* a stream of writes: install it writable */
            picked[k++] = (uint32_t)v;
        }
        pg_unlock(p, (uint64_t)v);
    }
    if (!k) return covered;
    /* wake as many workers as there are runs to fetch, not all of them for every few units */
    uint32_t run = PG_STREAM_RUN_BYTES / p->unit ? (uint32_t)(PG_STREAM_RUN_BYTES / p->unit) : 1;
    uint32_t wake = (k + run - 1) / run;
    pthread_mutex_lock(&p->q_mu);
    uint32_t pushed = 0;
    while (pushed < k && pg_queue_push(&p->pref, picked[pushed]) == 0) pushed++;
    for (uint32_t i = 0; i < wake && i < (uint32_t)p->nworkers; i++) pthread_cond_signal(&p->q_cv);
    pthread_mutex_unlock(&p->q_mu);
    PG_ADD(p, prefetched_units, pushed);
    if (pushed < k) { /* out of memory: the rest was not asked for after all */
        pg_fail(p, DLS_CALL_QUEUE, -ENOMEM, picked[pushed], k - pushed);
        for (uint32_t i = pushed; i < k; i++) { /* (one a fault claimed meanwhile is that fault's) */
            pg_lock(p, picked[i]);
            if (p->state[picked[i]] == U_FETCHING && !(p->flags[picked[i]] & (UF_CLAIMED | UF_QUEUED | UF_WAIT))) {
                p->state[picked[i]] = U_ABSENT;
                p->flags[picked[i]] &= (uint8_t)~UF_WRITE;
            }
            pg_unlock(p, picked[i]);
        }
    }
    return covered;
}

/* The thread left a stream for another part of the region: the units the old stream asked for that no
 * worker has started on go back to ABSENT (their queue entries are skipped when popped), so a stream
 * that ran past the end of what was read costs no transfers.  Under trend_mu. */
static void cancel_stream(dls_pager *p, int64_t from, int64_t to, int64_t stride) {
    uint64_t n = 0;
    for (int64_t v = from; stride > 0 ? v < to : v > to; v += stride) {
        if (v < 0 || (uint64_t)v >= p->nunits) break;
        pg_lock(p, (uint64_t)v);
        if (p->state[v] == U_FETCHING && !(p->flags[v] & (UF_CLAIMED | UF_QUEUED | UF_WAIT))) {
            p->state[v] = U_ABSENT;
            p->flags[v] &= (uint8_t)~UF_WRITE;
            n++;
        }
        pg_unlock(p, (uint64_t)v);
    }
    if (n) PG_ADD(p, stream_cancelled, n);
}

enum { A_NONE, A_WAKE, A_WOKEN, A_UNPROTECT, A_FETCH };

/* One fault message.  Returns 1 when the caller (a fault thread) has claimed unit *out and must fetch
 * it itself; everything else is settled here (a wake, an unprotect, a wait for a unit in transit). */
static int on_fault(dls_pager *p, uint64_t addr, uint64_t fl, uint32_t tid, uint64_t *out) {
    if (addr < (uintptr_t)p->base || addr >= (uintptr_t)p->base + p->size) return 0;
    uint64_t u = (addr - (uintptr_t)p->base) / p->unit;
    int wp = (fl & UFFD_PAGEFAULT_FLAG_WP) != 0, write = (fl & UFFD_PAGEFAULT_FLAG_WRITE) != 0;
    int action = A_NONE, demand = 0;
    pg_lock(p, u);
    uint8_t s = p->state[u];
    if (wp) {
        if (s == U_CLEAN || s == U_DIRTY) {
            /* CLEAN: the first write.  DIRTY: a second writer's stale fault, or a write after an unprotect
             * that failed; unprotecting again (which wakes the writer) costs what a wake does, and retries. */
            if (s == U_CLEAN && p->ref[u] < 3) p->ref[u]++; /* written: worth keeping (CLOCK) */
            p->state[u] = U_DIRTY;
            /* Unprotect (and wake the writer) before anyone can see DIRTY: an evictor that took the unit
             * between our unlock and a later unprotect would protect, copy and drop it, and the unprotect
             * would then let a write land that no write-back ever sees. */
            pg_make_writable(p, u);
            action = s == U_CLEAN ? A_UNPROTECT : A_WOKEN;
        } else if (s == U_ABSENT) { /* dropped after the write faulted: fetch it again, writable */
            p->state[u] = U_FETCHING;
            p->flags[u] |= UF_WRITE | UF_CLAIMED;
            action = A_FETCH;
        } else if (s == U_FETCHING || s == U_WRITEBACK || s == U_EVICTING) {
            p->flags[u] |= UF_WAIT | UF_WRITE;
        } else {
            action = A_WAKE; /* LOST: resolved already */
        }
    } else {
        if (s == U_ABSENT) {
            p->state[u] = U_FETCHING;
            p->flags[u] |= UF_CLAIMED | (write ? UF_WRITE : 0);
            uint32_t left = p->evict_seq[u];
            if (left && (uint32_t)(__atomic_load_n(&p->evict_clock, __ATOMIC_RELAXED) - left) <= p->local_units)
                p->ref[u] = 1; /* back soon after it left: keep it once more (CLOCK) */
            action = A_FETCH;
            demand = 1;
        } else if (s == U_FETCHING) {
            if (write) p->flags[u] |= UF_WRITE;
            if (!(p->flags[u] & (UF_QUEUED | UF_CLAIMED))) { /* a prefetch not started yet: now it is wanted */
                p->flags[u] |= UF_CLAIMED;
                action = A_FETCH;
            }
            demand = 1;
        } else if (s == U_EVICTING || s == U_WRITEBACK) {
            /* on its way out (WRITEBACK: moved out for its write-back, see pager_evict.c): it comes back
             * for us, from the evictor (which wakes us) or fetched again */
            p->flags[u] |= UF_WAIT | (write ? UF_WRITE : 0);
        } else {
            action = A_WAKE; /* installed before we read the message */
        }
    }
    pg_unlock(p, u);
    if (action == A_WAKE || action == A_WOKEN) {
        PG_ADD(p, faults_stale, 1);
        if (action == A_WAKE) {
            int rc = pg_wake(p, (uint8_t *)(uintptr_t)(addr & ~(uint64_t)(PAGE - 1)), PAGE);
            if (rc) pg_fail(p, DLS_CALL_WAKE, rc, u, 1);
        }
        return 0;
    }
    if (wp) PG_ADD(p, faults_wp, 1);
    else PG_ADD(p, faults_missing, 1);
    if (!wp && s == U_FETCHING) PG_ADD(p, faults_inflight, 1);
    if (demand && p->cfg.prefetch_bytes) { /* a stream: the fetch workers bring what follows meanwhile */
        int64_t first, stride;
        uint32_t max_depth = (uint32_t)(p->cfg.prefetch_bytes / p->unit);
        pthread_mutex_lock(&p->trend_mu);
        dls_trend *t = trend_for(p, tid, ++p->trend_seq);
        int64_t old_stride = t->stride, old_lo = t->lo, old_next = t->next;
        int left = old_stride != 0 && !dls_trend_follows(t, (int64_t)u);
        if (old_stride != 0 && !left && action == A_FETCH) { /* the reader caught up with its stream */
            pg_lock(p, u);
            p->flags[u] |= UF_STREAM;
            pg_unlock(p, u);
        }
        uint32_t n = dls_trend_fault(t, (int64_t)u, max_depth, &first, &stride);
        if (left) cancel_stream(p, old_lo + old_stride, old_next, old_stride);
        if (n) {
            uint32_t covered = prefetch(p, first, stride, n, write);
            if (covered < n) dls_trend_cut(t, first + stride * (int64_t)covered); /* the rest was not asked for */
        }
        pthread_mutex_unlock(&p->trend_mu);
    }
    if (action != A_FETCH) return 0;
    *out = u;
    return 1;
}

static void fetch_claimed(dls_pager *p, pg_io *io, uint64_t *units, uint32_t n, int stream);

/* A fault thread: it reads fault messages (each message goes to one of the fault threads: the
 * descriptor is in each thread's epoll set with EPOLLEXCLUSIVE) and fetches the units they ask for
 * itself, one batched read per extent, with no hand-off to another thread on the way: a missing
 * fault costs the wake of this thread, the donor's round trip and the wake of the faulting thread.
 * While one fault thread waits on a donor, the others take the next faults. */
int pg_faulter_init(dls_pager *p, pg_faulter *f) {
    f->p = p;
    f->ep = -1;
    int e = 0;
    struct epoll_event uev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.u32 = 0};
    struct epoll_event wev = {.events = EPOLLIN, .data.u32 = 1};
    if (!(f->io = pg_io_new(p))) e = -ENOMEM;
    else if ((f->ep = epoll_create1(EPOLL_CLOEXEC)) < 0) e = -errno;
    else if (epoll_ctl(f->ep, EPOLL_CTL_ADD, p->uffd, &uev) || epoll_ctl(f->ep, EPOLL_CTL_ADD, p->wakefd, &wev))
        e = -errno;
    if (e) {
        pg_faulter_free(f);
        return e;
    }
    f->io->spin_us = p->cfg.spin_us;
    return 0;
}

void pg_faulter_free(pg_faulter *f) {
    if (f->ep >= 0) close(f->ep);
    f->ep = -1;
    pg_io_free(f->io);
    f->io = NULL;
}

void *pg_fault_main(void *arg) {
    pg_faulter *f = arg;
    dls_pager *p = f->p;
    pg_io *io = f->io;
    int ep = f->ep;
    struct uffd_msg msgs[64];
    uint64_t mine[64];
    while (!p->closing) {
        struct epoll_event evs[2];
        int r = epoll_wait(ep, evs, 2, -1);
        if (r < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p->closing) break;
        ssize_t got = read(p->uffd, msgs, sizeof msgs);
        if (got < 0) {
            if (errno == EAGAIN || errno == EINTR) continue;
            break;
        }
        uint64_t t0 = pg_now_ns();
        uint32_t k = 0;
        for (ssize_t i = 0; i < got / (ssize_t)sizeof msgs[0]; i++) {
            if (msgs[i].event != UFFD_EVENT_PAGEFAULT) continue;
            k += (uint32_t)on_fault(p, msgs[i].arg.pagefault.address, msgs[i].arg.pagefault.flags,
                                    msgs[i].arg.pagefault.feat.ptid, &mine[k]);
        }
        PG_ADD(p, fault_ns, pg_now_ns() - t0);
        if (k) fetch_claimed(p, io, mine, k, 0);
    }
    return NULL;
}

/* UFFDIO_COPY of len bytes, waking nobody (install wakes the range once the units' states are
 * settled); 0, or -errno when the range is gone (the pager is closing). */
static int copy_in(dls_pager *p, uint8_t *dst, const uint8_t *src, uint64_t len, int writable) {
    uint64_t done = 0;
    while (done < len) {
        struct uffdio_copy c = {.dst = (uintptr_t)(dst + done), .src = (uintptr_t)(src + done), .len = len - done,
                                .mode = UFFDIO_COPY_MODE_DONTWAKE | ((writable || !p->wp) ? 0 : UFFDIO_COPY_MODE_WP)};
        if (ioctl(p->uffd, UFFDIO_COPY, &c) == 0) return 0;
        int e = errno;
        if (c.copy > 0) done += (uint64_t)c.copy;
        if (e == EAGAIN || e == EINTR) continue;
        if (e == EEXIST) { /* a page is there already (not ours to overwrite): step over it */
            done = (done / PAGE + 1) * PAGE;
            continue;
        }
        return -e;
    }
    return 0;
}

/* units[0..n) (sorted) are back to back in io->bounce: map them in, settle their states, then wake
 * the threads that faulted on them.  The wake comes last, so a thread that touched a unit in flight
 * finds it CLEAN or DIRTY when it runs again, never still FETCHING.  <0 when they could not be mapped
 * in (the range is gone). */
static int install(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n, int stream) {
    uint8_t writable[256];
    for (uint32_t i = 0; i < n; i++) {
        pg_lock(p, units[i]);
        writable[i] = (p->flags[units[i]] & UF_WRITE) || !p->wp;
        pg_unlock(p, units[i]);
    }
    for (uint32_t i = 0; i < n;) { /* one UFFDIO_COPY per run of adjacent units installed alike */
        uint32_t j = i + 1;
        while (j < n && writable[j] == writable[i] && units[j] == units[j - 1] + 1) j++;
        int rc = copy_in(p, pg_addr(p, units[i]), io->bounce + (size_t)i * p->unit, (uint64_t)(j - i) * p->unit,
                         writable[i]);
        if (rc < 0) return rc;
        i = j;
    }
    uint32_t delay = __atomic_load_n(&p->install_delay_us, __ATOMIC_RELAXED);
    if (delay && (stream || !__atomic_load_n(&p->delay_streams_only, __ATOMIC_RELAXED)))
        usleep(delay); /* testing: widen the window */
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v = units[i];
        pg_lock(p, v);
        uint8_t st = writable[i] ? U_DIRTY : U_CLEAN;
        if (st == U_CLEAN && (p->flags[v] & (UF_WAIT | UF_WRITE))) { /* a write came (or was announced) meanwhile */
            st = U_DIRTY;
            pg_make_writable(p, v);
        }
        p->state[v] = st;
        p->flags[v] &= (uint8_t)~(UF_WAIT | UF_WRITE | UF_CLAIMED | UF_QUEUED);
        if (stream) p->flags[v] |= UF_STREAM; /* (a fault at a stream's front marked its unit already) */
        pg_unlock(p, v);
        pg_ring_add(p, v);
    }
    for (uint32_t i = 0; i < n;) { /* one wake per run of adjacent units */
        uint32_t j = i + 1;
        while (j < n && units[j] == units[j - 1] + 1) j++;
        pg_wake_units(p, units[i], j - i);
        i = j;
    }
    pg_installed(p);
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Fetch and install units[0..n) (sorted, one extent), or poison them when no copy has them. */
static void fetch_group(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n, int stream) {
    pg_reserve(p, n);
    uint64_t t0 = pg_now_ns();
    int rc = p->closing ? DLS_E_CLOSED : pg_fetch(p, io, units, n);
    uint64_t t1 = pg_now_ns();
    PG_ADD(p, fetch_ns, t1 - t0);
    if (stream) PG_ADD(p, stream_runs, 1);
    else PG_ADD(p, demand_runs, 1);
    if (rc == DLS_OK) rc = install(p, io, units, n, stream); /* -errno: the range is gone (closing) */
    PG_ADD(p, install_ns, pg_now_ns() - t1);
    if (rc == DLS_OK) return;
    pg_release(p, n);
    if (p->closing) return;
    uint32_t idx;
    pg_extent_of(p, units[0], &idx);
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        while (j < n && units[j] == units[j - 1] + 1) j++;
        pg_lose(p, idx, units[i], j - i, rc);
        i = j;
    }
}

/* Take the popped units: claim them (another worker may have them), then fetch what is ours, one
 * batched read per extent, however scattered the units are in it. */
static void serve(dls_pager *p, pg_io *io, const uint32_t *units, uint32_t n, int stream) {
    uint64_t mine[256];
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v = units[i];
        pg_lock(p, v);
        if (p->state[v] == U_FETCHING && !(p->flags[v] & UF_CLAIMED)) {
            p->flags[v] |= UF_CLAIMED;
            mine[k++] = v;
        }
        pg_unlock(p, v);
    }
    fetch_claimed(p, io, mine, k, stream);
}

/* Fetch units this thread claimed (in any order, possibly several extents), one batched read per
 * extent. */
static void fetch_claimed(dls_pager *p, pg_io *io, uint64_t *units, uint32_t n, int stream) {
    qsort(units, n, sizeof units[0], cmp_u64);
    for (uint32_t i = 0; i < n;) {
        pg_extent *e = pg_extent_of(p, units[i], NULL);
        uint64_t end = e->first_unit + e->nunits;
        uint32_t j = i + 1;
        while (j < n && units[j] < end && j - i < io->max_units) j++;
        fetch_group(p, io, units + i, j - i, stream);
        i = j;
    }
}

void *pg_worker_main(void *arg) {
    dls_pager *p = arg;
    pg_io *io = pg_io_new(p);
    if (!io) {
        pg_fail(p, DLS_CALL_THREAD, -ENOMEM, 0, 0);
        return NULL;
    }
    uint32_t max = io->max_units > 256 ? 256 : io->max_units;
    uint32_t stream_max = PG_STREAM_RUN_BYTES / p->unit ? (uint32_t)(PG_STREAM_RUN_BYTES / p->unit) : 1;
    if (stream_max > max) stream_max = max;
    uint32_t units[256];
    for (;;) {
        pthread_mutex_lock(&p->q_mu);
        while (!p->closing && !p->demand.len && !p->pref.len) pthread_cond_wait(&p->q_cv, &p->q_mu);
        if (p->closing) {
            pthread_mutex_unlock(&p->q_mu);
            break;
        }
        uint32_t n = 0, nx;
        int stream = !p->demand.len;
        if (p->demand.len) {
            /* faults and prefetch calls first: this worker's share of what waits (the others take the
             * rest in parallel), read as one batch per extent */
            uint64_t share = (p->demand.len + (uint64_t)p->nworkers - 1) / (uint64_t)p->nworkers;
            while (n < max && n < share && pg_queue_pop(&p->demand, &nx) == 0) units[n++] = nx;
        } else {
            /* a sequential stream: a run of adjacent units of one extent */
            pg_queue_pop(&p->pref, &units[n++]);
            pg_extent *e = pg_extent_of(p, units[0], NULL);
            uint64_t end = e->first_unit + e->nunits;
            while (n < stream_max && pg_queue_peek(&p->pref, &nx) == 0 && nx == units[n - 1] + 1 && nx < end) {
                pg_queue_pop(&p->pref, &nx);
                units[n++] = nx;
            }
        }
        pthread_mutex_unlock(&p->q_mu);
        serve(p, io, units, n, stream);
    }
    pg_io_free(io);
    return NULL;
}
