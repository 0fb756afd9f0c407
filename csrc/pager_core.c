/* The region engine's shared pieces: the copy map, events, per-thread connections,
 * the residency budget and the userfaultfd calls every thread uses.  See pager_core.h. */
#define _GNU_SOURCE
#include "pager_core.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>

#include "wire.h"

/* --- the copy map ------------------------------------------------------------------------------ */

pg_extent *pg_extent_of(dls_pager *p, uint64_t u, uint32_t *idx) {
    uint32_t lo = 0, hi = p->next;
    while (hi - lo > 1) { /* extents are defined in order and cover every unit */
        uint32_t mid = lo + (hi - lo) / 2;
        if (p->ext[mid].first_unit <= u) lo = mid;
        else hi = mid;
    }
    if (idx) *idx = lo;
    return &p->ext[lo];
}

uint32_t pg_copies(pg_extent *e, pg_copy *out) {
    pthread_mutex_lock(&e->map);
    uint32_t n = e->ncopies;
    memcpy(out, e->copies, n * sizeof *out);
    pthread_mutex_unlock(&e->map);
    return n;
}

void pg_event(dls_pager *p, const dls_pager_event *ev) {
    pthread_mutex_lock(&p->ev_mu);
    if (p->ev_len == PG_EV_CAP) {
        PG_ADD(p, events_dropped, 1);
    } else {
        p->ev[(p->ev_head + p->ev_len) % PG_EV_CAP] = *ev;
        p->ev_len++;
        pthread_cond_signal(&p->ev_cv);
    }
    pthread_mutex_unlock(&p->ev_mu);
}

void pg_fail(dls_pager *p, int call, int err, uint64_t u, uint64_t n) {
    PG_ADD(p, engine_errors, 1);
    uint32_t idx = 0;
    if (p->next && u < p->nunits) pg_extent_of(p, u, &idx);
    dls_pager_event ev = {.kind = DLS_EV_ENGINE_ERROR, .extent = idx, .endpoint = -1, .code = err, .unit = u,
                          .count = n, .call = call};
    pg_event(p, &ev);
}

void pg_count_durable_locked(pg_extent *e) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->ncopies; i++)
        n += !e->copies[i].failed && (e->copies[i].role == DLS_COPY_LIVE || e->copies[i].role == DLS_COPY_EVICTING);
    __atomic_store_n(&e->durable, n, __ATOMIC_RELEASE);
}

void pg_copy_failed(dls_pager *p, uint32_t idx, const pg_copy *c, int code) {
    pg_extent *e = &p->ext[idx];
    int first = 0;
    pthread_mutex_lock(&e->map);
    for (uint32_t i = 0; i < e->ncopies; i++) {
        pg_copy *x = &e->copies[i];
        if (x->ep == c->ep && x->slab == c->slab && !memcmp(x->token, c->token, 16)) {
            first = !x->failed;
            x->failed = 1;
        }
    }
    pg_count_durable_locked(e);
    pthread_mutex_unlock(&e->map);
    if (!first) return;
    PG_ADD(p, copy_failures, 1);
    dls_pager_event ev = {.kind = DLS_EV_COPY_FAILED, .extent = idx, .endpoint = c->ep, .slab = c->slab,
                          .code = code};
    pg_event(p, &ev);
}

/* --- per-thread connections -------------------------------------------------------------------- */

pg_io *pg_io_new(dls_pager *p) {
    pg_io *io = calloc(1, sizeof *io);
    if (!io) return NULL;
    io->max_units = (uint32_t)(PG_MAX_RUN_BYTES / p->unit);
    if (io->max_units < 1) io->max_units = 1;
    size_t n = io->max_units;
    io->bounce = aligned_alloc(4096, n * p->unit);
    io->offs = calloc(n, sizeof *io->offs);
    io->lens = calloc(n, sizeof *io->lens);
    io->crcs = calloc(n, sizeof *io->crcs);
    io->units = calloc(n, sizeof *io->units);
    if (!io->bounce || !io->offs || !io->lens || !io->crcs || !io->units) {
        pg_io_free(io);
        return NULL;
    }
    return io;
}

void pg_io_free(pg_io *io) {
    if (!io) return;
    for (int i = 0; i < DLS_PAGER_MAX_ENDPOINTS; i++)
        if (io->conn[i]) dls_ep_close(io->conn[i]);
    free(io->bounce);
    free(io->offs);
    free(io->lens);
    free(io->crcs);
    free(io->units);
    free(io);
}

dls_ep *pg_io_conn(dls_pager *p, pg_io *io, int32_t ep) {
    if (ep < 0 || ep >= DLS_PAGER_MAX_ENDPOINTS) return NULL;
    if (io->conn[ep]) return io->conn[ep];
    pthread_mutex_lock(&p->ep_mu);
    pg_endpoint e = p->eps[ep];
    int known = ep < p->neps;
    pthread_mutex_unlock(&p->ep_mu);
    if (!known) return NULL;
    char err[256]; /* the caller reports the copy failed (DLS_E_IO): the reason is not needed */
    if (dls_ep_connect("tcp", e.host, e.port, p->cfg.io_timeout_ms, &io->conn[ep], err, sizeof err)) return NULL;
    return io->conn[ep];
}

void pg_io_drop(pg_io *io, int32_t ep) {
    if (ep >= 0 && ep < DLS_PAGER_MAX_ENDPOINTS && io->conn[ep]) {
        dls_ep_close(io->conn[ep]);
        io->conn[ep] = NULL;
    }
}

/* --- residency --------------------------------------------------------------------------------- */

#define BUDGET_PATIENCE_MS 2000 /* then go over budget rather than stall a fault forever */

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void pg_reserve(dls_pager *p, uint64_t n) {
    pthread_mutex_lock(&p->slot_mu);
    uint64_t start = 0, t0 = 0;
    while (p->resident + n > p->local_units && !p->closing) {
        if (!start) {
            t0 = pg_now_ns();
            start = now_ms();
            PG_ADD(p, budget_waits, 1);
        } else if (now_ms() - start >= BUDGET_PATIENCE_MS) {
            PG_ADD(p, over_budget, 1);
            break;
        }
        p->evict_now = 1;
        pthread_cond_broadcast(&p->evict_cv);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        p->slot_waiters++;
        pthread_cond_timedwait(&p->slot_cv, &p->slot_mu, &ts);
        p->slot_waiters--;
    }
    if (t0) PG_ADD(p, reserve_wait_ns, pg_now_ns() - t0);
    p->resident += n;
    if (p->resident > p->hi && p->evictors_asleep) pthread_cond_broadcast(&p->evict_cv);
    pthread_mutex_unlock(&p->slot_mu);
}

void pg_release(dls_pager *p, uint64_t n) {
    pthread_mutex_lock(&p->slot_mu);
    p->resident = p->resident >= n ? p->resident - n : 0;
    if (p->slot_waiters) pthread_cond_broadcast(&p->slot_cv);
    pthread_mutex_unlock(&p->slot_mu);
}

void pg_installed(dls_pager *p) {
    /* The states were stored before this (unit locks); a waiter counts itself before it reads them:
     * the fence orders our stores before our read of the count, so one of us sees the other. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&p->inst_waiters, __ATOMIC_SEQ_CST)) return;
    pthread_mutex_lock(&p->inst_mu);
    pthread_cond_broadcast(&p->inst_cv);
    pthread_mutex_unlock(&p->inst_mu);
}

/* --- userfaultfd calls -------------------------------------------------------------------------- */

int pg_protect(dls_pager *p, uint64_t u, uint64_t n, int on) {
    if (!p->wp) return 0;
    struct uffdio_writeprotect wp = {.range = {.start = (uintptr_t)pg_addr(p, u), .len = n * p->unit},
                                     .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0};
    for (;;) {
        if (ioctl(p->uffd, UFFDIO_WRITEPROTECT, &wp) == 0) return 0;
        if (errno != EAGAIN && errno != EINTR) return -errno;
    }
}

int pg_wake(dls_pager *p, uint8_t *addr, uint64_t len) {
    struct uffdio_range r = {.start = (uintptr_t)addr, .len = len};
    return ioctl(p->uffd, UFFDIO_WAKE, &r) == 0 ? 0 : -errno;
}

void pg_wake_units(dls_pager *p, uint64_t u, uint64_t n) {
    int rc = pg_wake(p, pg_addr(p, u), n * p->unit);
    if (rc) pg_fail(p, DLS_CALL_WAKE, rc, u, n);
}

int pg_make_writable(dls_pager *p, uint64_t u) {
    int rc = pg_protect(p, u, 1, 0);
    if (rc) {
        pg_fail(p, DLS_CALL_UNPROTECT, rc, u, 1);
        pg_wake_units(p, u, 1);
    }
    return rc;
}

void pg_lose(dls_pager *p, uint32_t idx, uint64_t u, uint64_t n, int code) {
    uint8_t *a = pg_addr(p, u);
    uint64_t len = n * p->unit;
    int done = 0;
    if (p->poison) {
        struct uffdio_poison po = {.range = {.start = (uintptr_t)a, .len = len}, .mode = 0};
        while (!done) {
            if (ioctl(p->uffd, UFFDIO_POISON, &po) == 0) done = 1;
            else if (errno != EAGAIN && errno != EINTR) break;
        }
    }
    if (!done && p->poison) pg_fail(p, DLS_CALL_POISON, -errno, u, n);
    if (!done && !p->closing) {
        /* no UFFDIO_POISON: make the range inaccessible instead (SIGSEGV), then wake the waiters */
        if (mmap(a, len, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED)
            pg_fail(p, DLS_CALL_POISON, -errno, u, n);
        pg_wake_units(p, u, n);
    }
    for (uint64_t i = 0; i < n; i++) {
        pg_lock(p, u + i);
        p->state[u + i] = U_LOST;
        p->flags[u + i] &= (uint8_t)~(UF_WAIT | UF_WRITE | UF_CLAIMED | UF_QUEUED);
        pg_unlock(p, u + i);
    }
    PG_ADD(p, units_lost, n);
    dls_pager_event ev = {.kind = DLS_EV_UNITS_LOST, .extent = idx, .endpoint = -1, .code = code, .unit = u,
                          .count = n};
    pg_event(p, &ev);
    pg_installed(p);
}
