/* The region engine's public face: create (map, userfaultfd), the copy map, start, prefetch,
 * flush, rebuild copies, events, stats, close and free.  See pager.h. */
#define _GNU_SOURCE
#include "pager.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include "pagecrc.h"
#include "pager_core.h"
#include "pager_queue.h"
#include "wire.h"

static int open_uffd(int extra) { return (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | extra); }

/* The features this kernel offers (UFFDIO_API may be called once per descriptor: ask on a spare one). */
/* 0, or -errno and the reason in err. */
static int uffd_open(dls_pager *p, char *err, size_t err_len) {
    int fd = open_uffd(0);
    if (fd < 0 && errno == EPERM) {
        /* vm.unprivileged_userfaultfd = 0 and no CAP_SYS_PTRACE: user-mode faults only (a system call
         * that touches an unfetched page then fails with EFAULT instead of waiting for it) */
        fd = open_uffd(UFFD_USER_MODE_ONLY);
        p->user_mode_only = fd >= 0;
    }
    if (fd < 0) {
        int e = errno;
        snprintf(err, err_len, "userfaultfd: %s (run as root, or set vm.unprivileged_userfaultfd = 1)", strerror(e));
        return -e;
    }
    struct uffdio_api probe = {.api = UFFD_API, .features = 0};
    if (ioctl(fd, UFFDIO_API, &probe) != 0) {
        int e = errno;
        snprintf(err, err_len, "UFFDIO_API (probing the features): %s", strerror(e));
        close(fd);
        return -e;
    }
    uint64_t have = probe.features;
    close(fd);
    fd = open_uffd(p->user_mode_only ? UFFD_USER_MODE_ONLY : 0);
    uint64_t want = UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_THREAD_ID | UFFD_FEATURE_POISON | UFFD_FEATURE_MOVE;
    struct uffdio_api api = {.api = UFFD_API, .features = want & have};
    if (fd < 0 || ioctl(fd, UFFDIO_API, &api) != 0) {
        int e = errno;
        snprintf(err, err_len, "UFFDIO_API: %s", strerror(e));
        if (fd >= 0) close(fd);
        return -e;
    }
    p->uffd = fd;
    p->poison = (api.features & UFFD_FEATURE_POISON) != 0;
    struct uffdio_register reg = {.range = {.start = (uintptr_t)p->base, .len = p->size},
                                  .mode = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP};
    p->wp = (api.features & UFFD_FEATURE_PAGEFAULT_FLAG_WP) && ioctl(fd, UFFDIO_REGISTER, &reg) == 0;
    if (!p->wp) { /* no write-protect on anonymous memory: every installed unit counts as dirty */
        reg.mode = UFFDIO_REGISTER_MODE_MISSING;
        if (ioctl(fd, UFFDIO_REGISTER, &reg) != 0) {
            int e = errno;
            snprintf(err, err_len, "UFFDIO_REGISTER: %s", strerror(e));
            return -e;
        }
    }
    if (!(reg.ioctls & (1ull << 0x08))) p->poison = 0; /* _UFFDIO_POISON */
    p->move = !p->cfg.no_move && (api.features & UFFD_FEATURE_MOVE) && (reg.ioctls & (1ull << _UFFDIO_MOVE));
    return 0;
}

static int check_config(const dls_pager_config *c, char *err, size_t err_len) {
    const char *why = NULL;
    if (c->unit < 4096 || c->unit % 4096 || c->unit > DLS_PAGER_MAX_UNIT) why = "unit must be a multiple of 4096, at most 1 MiB";
    else if (!c->nbytes || c->nbytes % c->unit) why = "nbytes must be a positive multiple of unit";
    else if (c->nbytes / c->unit >= (1ull << 32)) why = "too many units (at most 2^32)";
    else if (c->local_bytes < 4ull * c->unit) why = "local_bytes must hold at least 4 units";
    else if (c->policy < DLS_PAGER_FIFO || c->policy > DLS_PAGER_RANDOM) why = "unknown eviction policy";
    else if (c->fetch_workers < 1 || c->fetch_workers > 64) why = "fetch_workers must be 1..64";
    else if (c->evict_threads < 1 || c->evict_threads > 16) why = "evict_threads must be 1..16";
    else if (c->fault_threads < 0 || c->fault_threads > PG_MAX_FAULT_THREADS) why = "fault_threads must be 0..16";
    else if (c->spin_us > 10000) why = "spin_us must be at most 10000";
    else if (!c->nextents) why = "no extents";
    if (why) snprintf(err, err_len, "%s", why);
    return why ? -EINVAL : 0;
}

/* Free the half-made pager p and return -errno e, the reason in err already. */
static int create_failed(dls_pager *p, int e) {
    dls_pager_free(p);
    return -e;
}

int dls_pager_create(const dls_pager_config *cfg, dls_pager **out, char *err, size_t err_len) {
    *out = NULL;
    int rc = check_config(cfg, err, err_len);
    if (rc) return rc;
    dls_pager *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(err, err_len, "out of memory (the region engine's state)");
        return -ENOMEM;
    }
    p->cfg = *cfg;
    if (p->cfg.io_timeout_ms <= 0) p->cfg.io_timeout_ms = 5000;
    if (p->cfg.fault_threads <= 0) p->cfg.fault_threads = 2;
    p->uffd = p->wakefd = -1;
    p->unit = cfg->unit;
    p->size = cfg->nbytes;
    p->nunits = cfg->nbytes / cfg->unit;
    p->local_units = cfg->local_bytes / cfg->unit;
    /* room for faults while the evictor runs, and how much one wake-up evicts: batches of several
     * units, so a write-back is one pipelined request per copy, not one round trip per unit */
    uint64_t slack = p->local_units / 32 ? p->local_units / 32 : 1;
    uint64_t step = p->local_units / 8;
    uint64_t floor_step = p->local_units / 4 < 8 ? p->local_units / 4 : 8;
    if (step < floor_step) step = floor_step;
    if (step < 1) step = 1;
    p->hi = p->local_units - slack;
    p->lo = p->hi > step ? p->hi - step : 0;
    p->rng = 0x9E3779B97F4A7C15ull;
    /* a stream's units stay young (not evicted as spent) for two prefetch windows, or an eighth of the
     * budget when that is less: what the reader has not reached yet */
    uint64_t window = cfg->prefetch_bytes ? 2 * cfg->prefetch_bytes / cfg->unit : 0;
    p->young_max = window < p->local_units / 8 ? window : p->local_units / 8;
    PG_STAT(p, local_units) = p->local_units;
    p->state = calloc(p->nunits, 1);
    p->flags = calloc(p->nunits, 1);
    p->ref = calloc(p->nunits, 1);
    p->crc = calloc(p->nunits, sizeof *p->crc);
    p->evict_seq = calloc(p->nunits, sizeof *p->evict_seq);
    p->ext = calloc(cfg->nextents, sizeof *p->ext);
    p->zeros = aligned_alloc(4096, p->unit);
    for (int i = 0; i < PG_STRIPES; i++) pthread_mutex_init(&p->stripe[i], NULL);
    pthread_mutex_init(&p->ep_mu, NULL);
    pthread_mutex_init(&p->q_mu, NULL);
    pthread_cond_init(&p->q_cv, NULL);
    pthread_mutex_init(&p->slot_mu, NULL);
    pthread_cond_init(&p->slot_cv, NULL);
    pthread_cond_init(&p->evict_cv, NULL);
    pthread_mutex_init(&p->ring_mu, NULL);
    pthread_mutex_init(&p->inst_mu, NULL);
    pthread_cond_init(&p->inst_cv, NULL);
    pthread_mutex_init(&p->ev_mu, NULL);
    pthread_mutex_init(&p->trend_mu, NULL);
    pthread_cond_init(&p->ev_cv, NULL);
    if (!p->state || !p->flags || !p->ref || !p->crc || !p->evict_seq || !p->ext || !p->zeros ||
        pg_queue_init(&p->demand, p->nunits < 4096 ? p->nunits : 4096) ||
        pg_queue_init(&p->pref, 4096) || pg_queue_init(&p->ring, p->nunits < 65536 ? p->nunits : 65536) ||
        pg_queue_init(&p->young, 4096) || !(p->spent = malloc((p->spent_cap = 4096) * sizeof *p->spent))) {
        snprintf(err, err_len, "out of memory");
        return create_failed(p, ENOMEM);
    }
    memset(p->zeros, 0, p->unit);
    p->zero_crc = dls_crc32c_pages(0, p->zeros, p->unit);
    p->base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p->base == MAP_FAILED) {
        int e = errno;
        snprintf(err, err_len, "mmap of %llu bytes: %s", (unsigned long long)p->size, strerror(e));
        p->base = NULL;
        return create_failed(p, e);
    }
    /* A forked child gets no mapping at all (SIGSEGV on touch), never unregistered pages that would
     * read as zeros. */
    if (madvise(p->base, p->size, MADV_DONTFORK) != 0) {
        int e = errno;
        snprintf(err, err_len, "MADV_DONTFORK: %s", strerror(e));
        return create_failed(p, e);
    }
    /* units are managed in 4 KiB pages (EINVAL: a kernel without transparent huge pages, nothing to undo) */
    if (madvise(p->base, p->size, MADV_NOHUGEPAGE) != 0 && errno != EINVAL) {
        int e = errno;
        snprintf(err, err_len, "MADV_NOHUGEPAGE: %s", strerror(e));
        return create_failed(p, e);
    }
    if ((rc = uffd_open(p, err, err_len)) != 0) return create_failed(p, -rc);
    p->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (p->wakefd < 0) {
        int e = errno;
        snprintf(err, err_len, "eventfd (the fault threads' wake-up): %s", strerror(e));
        return create_failed(p, e);
    }
    PG_STAT(p, user_mode_only) = (uint64_t)p->user_mode_only;
    PG_STAT(p, write_protect) = (uint64_t)p->wp;
    PG_STAT(p, move_evict) = (uint64_t)p->move;
    *out = p;
    return 0;
}

void *dls_pager_base(dls_pager *p) { return p->base; }
uint64_t dls_pager_size(dls_pager *p) { return p->size; }

int dls_pager_endpoint(dls_pager *p, const char *host, int port) {
    if (!host || strlen(host) >= sizeof p->eps[0].host || port <= 0 || port > 65535) return DLS_E_ARG;
    pthread_mutex_lock(&p->ep_mu);
    int id = -1;
    for (int i = 0; i < p->neps; i++)
        if (p->eps[i].port == port && !strcmp(p->eps[i].host, host)) id = i;
    if (id < 0 && p->neps < DLS_PAGER_MAX_ENDPOINTS) {
        id = p->neps;
        snprintf(p->eps[id].host, sizeof p->eps[id].host, "%s", host);
        p->eps[id].port = port;
        p->neps++; /* after the entry is written: pg_io_conn reads it under the same lock */
    }
    pthread_mutex_unlock(&p->ep_mu);
    return id < 0 ? DLS_E_ARG : id;
}

int dls_pager_set_extent(dls_pager *p, uint32_t idx, uint64_t first_unit, uint64_t nunits, uint32_t ncopies,
                         const int32_t *eps, const uint32_t *slabs, const uint8_t *tokens, const uint8_t *roles) {
    if (idx >= p->cfg.nextents || ncopies > DLS_PAGER_MAX_COPIES || !nunits || first_unit + nunits > p->nunits)
        return DLS_E_ARG;
    for (uint32_t i = 0; i < ncopies; i++)
        if (eps[i] < 0 || eps[i] >= p->neps || roles[i] < DLS_COPY_LIVE || roles[i] > DLS_COPY_EVICTING)
            return DLS_E_ARG;
    pg_extent *e = &p->ext[idx];
    if (!e->defined) {
        if (p->started || idx != p->next || first_unit != (idx ? p->ext[idx - 1].first_unit + p->ext[idx - 1].nunits : 0))
            return DLS_E_ARG; /* defined once, in order, before start, back to back */
        pthread_mutex_init(&e->io, NULL);
        pthread_mutex_init(&e->map, NULL);
        e->first_unit = first_unit;
        e->nunits = nunits;
        e->defined = 1;
        p->next = idx + 1;
    } else if (e->first_unit != first_unit || e->nunits != nunits) {
        return DLS_E_ARG;
    }
    pthread_mutex_lock(&e->map);
    pg_copy fresh[DLS_PAGER_MAX_COPIES];
    for (uint32_t i = 0; i < ncopies; i++) {
        pg_copy *c = &fresh[i];
        c->ep = eps[i];
        c->slab = slabs[i];
        memcpy(c->token, tokens + 16 * i, 16);
        c->role = roles[i];
        c->failed = 0;
        for (uint32_t k = 0; k < e->ncopies; k++) /* what failed stays failed */
            if (e->copies[k].failed && e->copies[k].ep == c->ep && e->copies[k].slab == c->slab &&
                !memcmp(e->copies[k].token, c->token, 16))
                c->failed = 1;
    }
    memcpy(e->copies, fresh, ncopies * sizeof fresh[0]);
    e->ncopies = ncopies;
    pg_count_durable_locked(e);
    pthread_mutex_unlock(&e->map);
    return DLS_OK;
}

/* One pass of dls_pager_salvage_extent over extent idx: units that are not resident but had data are
 * lost (claimed first, as a fetch worker claims them, so that no fault fetches one meanwhile; poisoned
 * a run of adjacent units at a time).  Returns how many units are still on their way: a fetch of data
 * (it will fail: no durable copy) or a drop. */
static uint64_t lose_absent(dls_pager *p, uint32_t idx) {
    pg_extent *e = &p->ext[idx];
    uint64_t moving = 0, run = 0, end = e->first_unit + e->nunits;
    for (uint64_t u = e->first_unit; u < end; u++) {
        pg_lock(p, u);
        uint8_t s = p->state[u], f = p->flags[u];
        int lose = s == U_ABSENT && (f & UF_HAS_DATA);
        if (lose) {
            p->state[u] = U_FETCHING;
            p->flags[u] |= UF_CLAIMED;
        } else if ((s == U_FETCHING && (f & UF_HAS_DATA)) || s == U_EVICTING) {
            moving++;
        }
        pg_unlock(p, u);
        if (lose) run++;
        if (run && (!lose || u + 1 == end)) { /* the run of claimed units ends here */
            uint64_t first = (lose ? u + 1 : u) - run;
            pg_lose(p, idx, first, run, DLS_E_IO);
            run = 0;
        }
    }
    return moving;
}

int64_t dls_pager_salvage_extent(dls_pager *p, uint32_t idx, int timeout_ms) {
    if (p->closing) return DLS_E_CLOSED;
    if (idx >= p->next || timeout_ms < 0) return DLS_E_ARG;
    pg_extent *e = &p->ext[idx];
    uint64_t deadline = pg_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        /* while no copy is durable a clean unit is never dropped and a dirty one never leaves (its
         * write-back fails): once nothing is on its way, no unit with data can become absent */
        if (__atomic_load_n(&e->durable, __ATOMIC_ACQUIRE)) return -EBUSY;
        if (!lose_absent(p, idx)) break;
        if (p->closing) return DLS_E_CLOSED;
        if (pg_now_ns() >= deadline) return -EAGAIN;
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
    int64_t kept = 0;
    for (uint64_t u = e->first_unit; u < e->first_unit + e->nunits; u++) {
        pg_lock(p, u);
        uint8_t s = p->state[u];
        if ((s == U_CLEAN && (p->flags[u] & UF_HAS_DATA)) || s == U_DIRTY || s == U_WRITEBACK) {
            if (s == U_CLEAN) {
                p->state[u] = U_DIRTY;
                pg_make_writable(p, u); /* under its lock, like every unprotect */
            }
            p->flags[u] &= (uint8_t)~UF_HAS_DATA;
            kept++;
        } else if (s == U_LOST) {
            p->flags[u] &= (uint8_t)~UF_HAS_DATA; /* poisoned for good: no rebuild reads it */
        }
        pg_unlock(p, u);
    }
    return kept;
}

int dls_pager_extent_copies(dls_pager *p, uint32_t idx, int32_t *eps, uint32_t *slabs, uint8_t *roles,
                            uint8_t *failed, uint32_t max) {
    if (idx >= p->next) return DLS_E_ARG;
    pg_copy cs[DLS_PAGER_MAX_COPIES];
    uint32_t n = pg_copies(&p->ext[idx], cs);
    for (uint32_t i = 0; i < n && i < max; i++) {
        eps[i] = cs[i].ep;
        slabs[i] = cs[i].slab;
        roles[i] = cs[i].role;
        failed[i] = cs[i].failed;
    }
    return (int)n;
}

void dls_pager_set_install_delay(dls_pager *p, uint32_t us, int streams_only) {
    __atomic_store_n(&p->delay_streams_only, streams_only != 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->install_delay_us, us, __ATOMIC_RELAXED);
}

int dls_pager_start(dls_pager *p, char *err, size_t err_len) {
    if (p->started) return 0;
    if (p->next != p->cfg.nextents || p->ext[p->next - 1].first_unit + p->ext[p->next - 1].nunits != p->nunits) {
        snprintf(err, err_len, "the extents do not cover the region");
        return -EINVAL;
    }
    p->faulters = calloc((size_t)p->cfg.fault_threads, sizeof(pthread_t));
    p->faulter_ctx = calloc((size_t)p->cfg.fault_threads, sizeof *p->faulter_ctx);
    if (!p->faulter_ctx) {
        snprintf(err, err_len, "out of memory");
        return -ENOMEM;
    }
    for (int i = 0; i < p->cfg.fault_threads; i++) p->faulter_ctx[i].ep = -1;
    for (int i = 0; i < p->cfg.fault_threads; i++) {
        int e = pg_faulter_init(p, &p->faulter_ctx[i]);
        if (e) {
            snprintf(err, err_len, "fault thread set-up (epoll on the userfaultfd): %s", strerror(-e));
            return e;
        }
    }
    p->workers = calloc((size_t)p->cfg.fetch_workers, sizeof(pthread_t));
    p->evictors = calloc((size_t)p->cfg.evict_threads, sizeof(pthread_t));
    if (!p->faulters || !p->workers || !p->evictors) {
        snprintf(err, err_len, "out of memory");
        return -ENOMEM;
    }
    p->started = 1;
    int rc = 0; /* count only the threads that started: close() joins those */
    for (int i = 0; !rc && i < p->cfg.fault_threads; i++)
        if (!(rc = pthread_create(&p->faulters[i], NULL, pg_fault_main, &p->faulter_ctx[i]))) p->nfaulters++;
    for (int i = 0; !rc && i < p->cfg.fetch_workers; i++)
        if (!(rc = pthread_create(&p->workers[i], NULL, pg_worker_main, p))) p->nworkers++;
    for (int i = 0; !rc && i < p->cfg.evict_threads; i++)
        if (!(rc = pthread_create(&p->evictors[i], NULL, pg_evict_main, p))) p->nevictors++;
    if (rc) {
        snprintf(err, err_len, "pthread_create: %s", strerror(rc));
        dls_pager_close(p);
        return -rc;
    }
    return 0;
}

static int not_ready(dls_pager *p, const uint64_t *units, uint64_t n, int *lost) {
    int64_t waiting = 0;
    *lost = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint8_t s = __atomic_load_n(&p->state[units[i]], __ATOMIC_ACQUIRE);
        waiting += s == U_FETCHING;
        *lost += s == U_LOST;
    }
    return (int)waiting;
}

int64_t dls_pager_prefetch(dls_pager *p, const uint64_t *units, uint64_t n, int write, int timeout_ms) {
    if (!p->started || p->closing) return -ESHUTDOWN;
    for (uint64_t i = 0; i < n; i++)
        if (units[i] >= p->nunits) return -EINVAL;
    uint64_t *queue = malloc((n ? n : 1) * sizeof *queue), nq = 0;
    if (!queue) return -ENOMEM;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t u = units[i];
        pg_lock(p, u);
        uint8_t s = p->state[u];
        if (s == U_ABSENT) {
            p->state[u] = U_FETCHING;
            p->flags[u] |= UF_QUEUED | (write ? UF_WRITE : 0);
            queue[nq++] = u;
        } else if (s == U_FETCHING) {
            if (write) p->flags[u] |= UF_WRITE;
            if (!(p->flags[u] & (UF_QUEUED | UF_CLAIMED))) {
                p->flags[u] |= UF_QUEUED;
                queue[nq++] = u;
            }
        } else if (s == U_EVICTING || s == U_WRITEBACK) {
            /* on its way out: keep it (write-back) or bring it straight back (drop), as for a fault */
            p->flags[u] |= UF_WAIT | (write ? UF_WRITE : 0);
        } else if (s == U_CLEAN && write && p->wp) {
            p->state[u] = U_DIRTY;
            pg_make_writable(p, u); /* under the lock: no evictor may protect it again in between */
        }
        if ((s == U_CLEAN || s == U_DIRTY) && p->ref[u] < 3) p->ref[u]++; /* wanted soon: CLOCK keeps it */
        pg_unlock(p, u);
    }
    uint64_t pushed = 0;
    if (nq) {
        pthread_mutex_lock(&p->q_mu);
        while (pushed < nq && pg_queue_push(&p->demand, (uint32_t)queue[pushed]) == 0) pushed++;
        pthread_cond_broadcast(&p->q_cv);
        pthread_mutex_unlock(&p->q_mu);
    }
    for (uint64_t i = pushed; i < nq; i++) pg_queue_demand(p, queue[i]); /* out of memory: that reports it */
    free(queue);
    if (timeout_ms <= 0) return 0;
    struct timespec end;
    clock_gettime(CLOCK_REALTIME, &end);
    end.tv_sec += timeout_ms / 1000;
    end.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) {
        end.tv_sec++;
        end.tv_nsec -= 1000000000L;
    }
    int lost = 0, waiting;
    pthread_mutex_lock(&p->inst_mu);
    __atomic_add_fetch(&p->inst_waiters, 1, __ATOMIC_SEQ_CST); /* before reading the states: pg_installed */
    while ((waiting = not_ready(p, units, n, &lost)) && !p->closing) {
        struct timespec now, step;
        clock_gettime(CLOCK_REALTIME, &now);
        if (now.tv_sec > end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec >= end.tv_nsec)) break;
        step = now;
        step.tv_nsec += 10 * 1000000L; /* installs broadcast; this only bounds a missed wake-up */
        if (step.tv_nsec >= 1000000000L) {
            step.tv_sec++;
            step.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&p->inst_cv, &p->inst_mu, &step);
    }
    __atomic_sub_fetch(&p->inst_waiters, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&p->inst_mu);
    return p->closing ? -ESHUTDOWN : waiting + lost;
}

int64_t dls_pager_flush(dls_pager *p) {
    if (!p->started || p->closing) return -ESHUTDOWN;
    return pg_flush(p);
}

int dls_pager_copy_extent(dls_pager *p, uint32_t idx, int32_t ep, uint32_t slab, const uint8_t *token,
                          uint64_t bytes_per_s) {
    if (p->closing) return DLS_E_CLOSED;
    return pg_copy_extent(p, idx, ep, slab, token, bytes_per_s);
}

int dls_pager_next_event(dls_pager *p, dls_pager_event *ev, int timeout_ms) {
    pthread_mutex_lock(&p->ev_mu);
    if (!p->ev_len && !p->closing && timeout_ms > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += timeout_ms / 1000;
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&p->ev_cv, &p->ev_mu, &ts);
    }
    int rc = -EAGAIN;
    if (p->ev_len) {
        *ev = p->ev[p->ev_head];
        p->ev_head = (p->ev_head + 1) % PG_EV_CAP;
        p->ev_len--;
        rc = 0;
    } else if (p->closing) {
        rc = -ESHUTDOWN;
    }
    pthread_mutex_unlock(&p->ev_mu);
    return rc;
}

void dls_pager_get_stats(dls_pager *p, dls_pager_stats *st) {
    const uint64_t *src = (const uint64_t *)&p->stats;
    uint64_t *dst = (uint64_t *)st;
    for (size_t i = 0; i < sizeof *st / sizeof(uint64_t); i++) dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
    pthread_mutex_lock(&p->slot_mu);
    st->resident_units = p->resident;
    /* (a woken evictor still counts as asleep until it has the lock: the conditions that woke it say it) */
    st->evictors_idle = p->nevictors > 0 && p->evictors_asleep == p->nevictors && p->resident <= p->hi &&
                        !p->evict_now;
    pthread_mutex_unlock(&p->slot_mu);
}

int dls_pager_unit_state(dls_pager *p, uint64_t unit) {
    if (unit >= p->nunits) return DLS_E_ARG;
    return __atomic_load_n(&p->state[unit], __ATOMIC_ACQUIRE);
}

uint64_t dls_pager_lost_in(dls_pager *p, uint64_t first, uint64_t n) {
    uint64_t lost = 0;
    for (uint64_t u = first; u < first + n && u < p->nunits; u++)
        lost += __atomic_load_n(&p->state[u], __ATOMIC_ACQUIRE) == U_LOST;
    return lost;
}

void dls_pager_close(dls_pager *p) {
    if (!p || p->closed) return;
    p->closed = 1;
    __atomic_store_n(&p->closing, 1, __ATOMIC_SEQ_CST);
    if (p->wakefd >= 0) {
        uint64_t one = 1;
        if (write(p->wakefd, &one, sizeof one) < 0) { /* the fault thread also checks `closing` */ }
    }
    pthread_mutex_t *mus[] = {&p->q_mu, &p->slot_mu, &p->inst_mu, &p->ev_mu};
    pthread_cond_t *cvs[] = {&p->q_cv, &p->slot_cv, &p->inst_cv, &p->ev_cv};
    for (int i = 0; i < 4; i++) {
        pthread_mutex_lock(mus[i]);
        pthread_cond_broadcast(cvs[i]);
        if (i == 1) pthread_cond_broadcast(&p->evict_cv);
        pthread_mutex_unlock(mus[i]);
    }
    /* The engine's threads first: an evictor may be copying a unit out of the mapping right now. */
    if (p->started) {
        for (int i = 0; i < p->nfaulters; i++) pthread_join(p->faulters[i], NULL);
        for (int i = 0; i < p->nworkers; i++) pthread_join(p->workers[i], NULL);
        for (int i = 0; i < p->nevictors; i++) pthread_join(p->evictors[i], NULL);
    }
    /* and the rebuild steps reading units out of the mapping (pager_io.c, read_resident): they saw
     * `closing` clear before they started, and end within one step */
    while (__atomic_load_n(&p->mem_readers, __ATOMIC_SEQ_CST)) sched_yield();
    if (p->base) {
        /* Then replace the mapping: its memory goes back, the registration with it; a thread blocked in
         * a fault is woken into the PROT_NONE range (SIGSEGV), and no later mapping can take the range
         * while views of it may still exist. */
        if (mmap(p->base, p->size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) ==
            MAP_FAILED)
            pg_fail(p, DLS_CALL_UNMAP, -errno, 0, p->nunits);
        if (p->uffd >= 0) {
            int rc = pg_wake(p, p->base, p->size);
            /* ENOENT: the range was unregistered with the mapping it replaced; nobody is waiting on it */
            if (rc && rc != -ENOENT) pg_fail(p, DLS_CALL_WAKE, rc, 0, p->nunits);
        }
    }
}

void dls_pager_free(dls_pager *p) {
    if (!p) return;
    dls_pager_close(p);
    /* descriptors last: a call that raced close() may still have used them */
    if (p->uffd >= 0) close(p->uffd);
    if (p->wakefd >= 0) close(p->wakefd);
    if (p->base) munmap(p->base, p->size);
    for (uint32_t i = 0; i < p->next; i++) {
        pthread_mutex_destroy(&p->ext[i].io);
        pthread_mutex_destroy(&p->ext[i].map);
    }
    pg_queue_free(&p->demand);
    pg_queue_free(&p->pref);
    pg_queue_free(&p->ring);
    pg_queue_free(&p->young);
    free(p->spent);
    free(p->state);
    free(p->flags);
    free(p->ref);
    free(p->crc);
    free(p->evict_seq);
    free(p->ext);
    free(p->zeros);
    if (p->faulter_ctx)
        for (int i = 0; i < p->cfg.fault_threads; i++) pg_faulter_free(&p->faulter_ctx[i]);
    free(p->faulter_ctx);
    free(p->faulters);
    free(p->workers);
    free(p->evictors);
    free(p);
}
