/* The region engine's data movement: fetch units from a readable copy (failing over, each unit
 * checked against the CRC-32C it had when it was written back), write units back to every
 * copy, and fill a new copy during a rebuild.  Each call runs on its own pg_io (connections
 * and a bounce buffer), so fetch workers and evictors never share a socket. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pager_core.h"
#include "pagecrc.h"
#include "wire.h"

static int same_copy(const pg_copy *a, int32_t ep, uint32_t slab, const uint8_t *token) {
    return a->ep == ep && a->slab == slab && !memcmp(a->token, token, 16);
}

/* Read io->units[0..n) (segments io->offs/io->lens, back to back into io->bounce) from one readable
 * copy of extent idx other than `skip`: live copies first, spread by `spread`, then copies being
 * evicted.  Each unit's CRC must match what was written back (zeros for a unit never written). */
static int read_any(dls_pager *p, pg_io *io, uint32_t idx, uint32_t n, uint64_t spread, const pg_copy *skip) {
    pg_extent *e = &p->ext[idx];
    pg_copy cs[DLS_PAGER_MAX_COPIES];
    uint32_t nc = pg_copies(e, cs);
    pg_copy order[DLS_PAGER_MAX_COPIES];
    uint32_t nl = 0, no = 0;
    for (uint32_t i = 0; i < nc; i++)
        if (cs[i].role == DLS_COPY_LIVE && !cs[i].failed) nl++;
    for (uint32_t i = 0; i < nc; i++) { /* live copies, starting at a spread position */
        pg_copy *c = &cs[(i + (nl ? spread % nc : 0)) % nc];
        if (c->role == DLS_COPY_LIVE && !c->failed) order[no++] = *c;
    }
    for (uint32_t i = 0; i < nc; i++)
        if (cs[i].role == DLS_COPY_EVICTING && !cs[i].failed) order[no++] = cs[i];
    int tried = 0;
    for (uint32_t k = 0; k < no; k++) {
        pg_copy *c = &order[k];
        if (skip && same_copy(c, skip->ep, skip->slab, skip->token)) continue;
        if (p->closing) return DLS_E_CLOSED;
        tried++;
        dls_ep *conn = pg_io_conn(p, io, c->ep);
        if (!conn) {
            pg_copy_failed(p, idx, c, DLS_E_IO);
            continue;
        }
        dls_batch b = {.slab = c->slab, .token = c->token, .nseg = n, .offs = io->offs, .lens = io->lens,
                       .buf = io->bounce, .flags = DLS_F_LOCAL_CRC, .crcs = io->crcs,
                       .timeout_ms = p->cfg.io_timeout_ms, .bad_seg = -1, .spin_us = io->spin_us};
        int rc = dls_ep_read(conn, &b);
        if (rc) {
            if (rc < 0) pg_io_drop(io, c->ep);
            pg_copy_failed(p, idx, c, rc);
            continue;
        }
        int bad = 0;
        for (uint32_t i = 0; i < n && !bad; i++) {
            uint64_t u = io->units[i];
            uint8_t f = __atomic_load_n(&p->flags[u], __ATOMIC_ACQUIRE);
            uint32_t want = (f & UF_HAS_DATA) ? __atomic_load_n(&p->crc[u], __ATOMIC_RELAXED) : p->zero_crc;
            bad = io->crcs[i] != want;
        }
        if (bad) {
            pg_copy_failed(p, idx, c, DLS_E_CRC);
            continue;
        }
        if (tried > 1) PG_ADD(p, failovers, 1);
        return DLS_OK;
    }
    return DLS_E_IO;
}

int pg_fetch(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n) {
    uint32_t idx;
    pg_extent *e = pg_extent_of(p, units[0], &idx);
    uint32_t with_data = 0;
    for (uint32_t i = 0; i < n; i++) {
        io->units[i] = units[i];
        io->offs[i] = (units[i] - e->first_unit) * p->unit;
        io->lens[i] = (uint32_t)p->unit;
        with_data += (__atomic_load_n(&p->flags[units[i]], __ATOMIC_ACQUIRE) & UF_HAS_DATA) != 0;
    }
    if (!with_data) { /* never written back: the copies hold zeros, no need to ask them */
        memset(io->bounce, 0, (size_t)n * p->unit);
        PG_ADD(p, zero_units, n);
        return DLS_OK;
    }
    int rc = read_any(p, io, idx, n, idx + units[0], NULL);
    if (rc == DLS_OK) {
        PG_ADD(p, fetch_runs, 1);
        PG_ADD(p, fetched_units, n);
        PG_ADD(p, bytes_fetched, (uint64_t)n * p->unit);
    }
    return rc;
}

/* One extent's share of a write-back: units[first, first+n) of the call. */
typedef struct wb_group {
    pg_extent *e;
    uint32_t idx, first, n, nc, m;
    pg_copy cs[DLS_PAGER_MAX_COPIES];
    int which[DLS_PAGER_MAX_COPIES]; /* the copies sent to, of cs */
} wb_group;

#define WB_GROUPS 16 /* extents written back together (with their copies, at most 128 batches) */

/* Write back the groups' units (their bytes at buf, back to back; the io's offs/lens/crcs filled),
 * every extent and every copy in one dls_ep_write_many.  The extents' io locks are held by the caller. */
static void write_groups(dls_pager *p, pg_io *io, const uint64_t *units, wb_group *g, uint32_t ng, uint8_t *buf,
                         uint8_t *ok) {
    dls_ep *eps[WB_GROUPS * DLS_PAGER_MAX_COPIES];
    dls_batch bs[WB_GROUPS * DLS_PAGER_MAX_COPIES], *bp[WB_GROUPS * DLS_PAGER_MAX_COPIES];
    int rcs[WB_GROUPS * DLS_PAGER_MAX_COPIES], m = 0;
    for (uint32_t x = 0; x < ng; x++) {
        wb_group *w = &g[x];
        w->nc = pg_copies(w->e, w->cs);
        w->m = 0;
        for (uint32_t k = 0; k < w->nc; k++) {
            pg_copy *c = &w->cs[k];
            if (c->failed || p->closing) continue;
            dls_ep *conn = pg_io_conn(p, io, c->ep);
            if (!conn) {
                pg_copy_failed(p, w->idx, c, DLS_E_IO);
                continue;
            }
            bs[m] = (dls_batch){.slab = c->slab, .token = c->token, .nseg = w->n, .offs = io->offs + w->first,
                                .lens = io->lens + w->first, .buf = buf + (size_t)w->first * p->unit, .flags = 0,
                                .crcs = NULL, .timeout_ms = p->cfg.io_timeout_ms, .bad_seg = -1};
            bp[m] = &bs[m];
            eps[m++] = conn;
            w->which[w->m++] = (int)k;
        }
    }
    if (m) dls_ep_write_many(eps, bp, m, rcs);
    int at = 0;
    for (uint32_t x = 0; x < ng; x++) {
        wb_group *w = &g[x];
        uint32_t durable = 0, sent = 0;
        for (uint32_t i = 0; i < w->m; i++) {
            pg_copy *c = &w->cs[w->which[i]];
            int rc = rcs[at++];
            if (rc < 0) pg_io_drop(io, c->ep);
            if (rc) {
                pg_copy_failed(p, w->idx, c, rc);
                continue;
            }
            sent++;
            if (c->role == DLS_COPY_LIVE || c->role == DLS_COPY_EVICTING) durable++;
        }
        if (durable) {
            for (uint32_t i = w->first; i < w->first + w->n; i++) {
                pg_lock(p, units[i]);
                __atomic_store_n(&p->crc[units[i]], io->crcs[i], __ATOMIC_RELAXED);
                __atomic_or_fetch(&p->flags[units[i]], UF_HAS_DATA, __ATOMIC_RELEASE);
                pg_unlock(p, units[i]);
            }
            PG_ADD(p, written_back_units, w->n);
            PG_ADD(p, bytes_written, (uint64_t)w->n * p->unit * sent);
        }
        memset(ok + w->first, durable != 0, w->n);
    }
}

/* A write-back's hold of an extent's io lock; the time it waited for it (behind a rebuild step or
 * another write-back of the extent) is the writeback_lock_wait_ns stat. */
static void pg_io_lock(dls_pager *p, pg_extent *e) {
    if (pthread_mutex_trylock(&e->io) == 0) return;
    uint64_t t0 = pg_now_ns();
    pthread_mutex_lock(&e->io);
    PG_ADD(p, writeback_lock_wait_ns, pg_now_ns() - t0);
}

void pg_write_back(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n, uint8_t *from, uint8_t *ok) {
    if (n > io->max_units) { /* the io's arrays hold one run's worth */
        pg_write_back(p, io, units, io->max_units, from, ok);
        pg_write_back(p, io, units + io->max_units, n - io->max_units, from ? from + (size_t)io->max_units * p->unit : NULL,
                      ok + io->max_units);
        return;
    }
    uint8_t *buf = from ? from : io->bounce;
    wb_group g[WB_GROUPS];
    for (uint32_t i = 0; i < n;) {
        /* up to WB_GROUPS extents, locked in unit order (every multi-extent locker's order) */
        uint32_t ng = 0;
        for (; i < n && ng < WB_GROUPS; ng++) {
            wb_group *w = &g[ng];
            w->e = pg_extent_of(p, units[i], &w->idx);
            uint64_t end = w->e->first_unit + w->e->nunits;
            w->first = i;
            while (i < n && units[i] < end) i++;
            w->n = i - w->first;
            pg_io_lock(p, w->e);
            for (uint32_t k = w->first; k < i; k++) {
                /* write-protected by the caller, or moved out of the mapping (`from`): these bytes cannot change */
                if (!from) memcpy(io->bounce + (size_t)k * p->unit, pg_addr(p, units[k]), p->unit);
                io->crcs[k] = dls_crc32c_pages(0, buf + (size_t)k * p->unit, p->unit);
                io->offs[k] = (units[k] - w->e->first_unit) * p->unit;
                io->lens[k] = (uint32_t)p->unit;
            }
        }
        write_groups(p, io, units, g, ng, buf, ok);
        for (uint32_t x = ng; x-- > 0;) pthread_mutex_unlock(&g[x].e->io);
    }
}

/* A paced rebuild waits after each step until what it copied so far is due at bytes_per_s (the last
 * step too: rebuilds of one extent after another keep to the cap), in slices of at most 20 ms so
 * that a close is not held up. */
static void pace(dls_pager *p, uint64_t t0, uint64_t copied, uint64_t bytes_per_s) {
    uint64_t due = t0 + (uint64_t)((double)copied * 1e9 / (double)bytes_per_s);
    for (uint64_t now = pg_now_ns(); now < due && !p->closing; now = pg_now_ns()) {
        uint64_t left = due - now < 20000000ull ? due - now : 20000000ull;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)left};
        nanosleep(&ts, NULL);
    }
}

/* The units of a rebuild step that this process holds (CLEAN or DIRTY: mapped) are copied from its own
 * memory instead of being read from a surviving copy: at 50% local about half the step's traffic, and
 * no work for the survivor.  Each is copied under its unit lock, so it stays mapped meanwhile (an
 * evictor moves it to EVICTING or WRITEBACK under that lock before it drops or moves the page); close
 * waits for mem_readers before it replaces the mapping.  The bytes are the unit's as written back, or
 * newer (a write since): newer ones are safe because a write-back of the extent takes its io lock,
 * which the caller holds across this copy and the step's write, so the unit's next write-back lands
 * on the new copy after them.  Moves the units copied to the front of units[0..n), their bytes in
 * buf in the same order, and returns how many; the rest must come from a copy. */
static uint32_t read_resident(dls_pager *p, uint64_t *units, uint32_t n, uint8_t *buf) {
    __atomic_add_fetch(&p->mem_readers, 1, __ATOMIC_SEQ_CST);
    uint32_t got = 0;
    if (!__atomic_load_n(&p->closing, __ATOMIC_SEQ_CST)) {
        uint64_t rest[PG_MAX_RUN_BYTES / 4096];
        uint32_t nr = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint64_t u = units[i];
            pg_lock(p, u);
            uint8_t s = p->state[u];
            if (s == U_CLEAN || s == U_DIRTY) {
                memcpy(buf + (size_t)got * p->unit, pg_addr(p, u), p->unit);
                units[got++] = u;
            } else {
                rest[nr++] = u;
            }
            pg_unlock(p, u);
        }
        memcpy(units + got, rest, nr * sizeof *rest);
    }
    __atomic_sub_fetch(&p->mem_readers, 1, __ATOMIC_SEQ_CST);
    return got;
}

/* Unit v of an extent starting at unit `first` as segment i of a rebuild step's read from a copy. */
static void step_seg(dls_pager *p, pg_io *io, uint32_t i, uint64_t v, uint64_t first) {
    io->units[i] = v;
    io->offs[i] = (v - first) * p->unit;
    io->lens[i] = (uint32_t)p->unit;
}

int pg_copy_extent(dls_pager *p, uint32_t idx, int32_t ep, uint32_t slab, const uint8_t *token,
                   uint64_t bytes_per_s) {
    if (idx >= p->next) return DLS_E_ARG;
    pg_extent *e = &p->ext[idx];
    pg_io *io = pg_io_new(p);
    if (!io) return -ENOMEM;
    /* the resident units of a step: their numbers, offsets and bytes (one run's worth, as io's) */
    size_t m = io->max_units;
    uint64_t *lunits = malloc(m * sizeof *lunits), *loffs = malloc(m * sizeof *loffs);
    uint32_t *llens = malloc(m * sizeof *llens);
    uint8_t *lbuf = malloc(m * p->unit);
    if (!lunits || !loffs || !llens || !lbuf) {
        free(lunits), free(loffs), free(llens), free(lbuf);
        pg_io_free(io);
        return -ENOMEM;
    }
    pg_copy target = {.ep = ep, .slab = slab, .role = DLS_COPY_REBUILDING};
    memcpy(target.token, token, 16);
    int rc = DLS_OK;
    uint64_t end = e->first_unit + e->nunits, t0 = pg_now_ns(), copied = 0;
    for (uint64_t u = e->first_unit; u < end && rc == DLS_OK;) {
        if (p->closing) {
            rc = DLS_E_CLOSED;
            break;
        }
        /* one step under the extent's io lock: no write-back lands between our read and our write */
        pthread_mutex_lock(&e->io);
        uint32_t n = 0, nl = 0;
        uint64_t v = u;
        for (; v < end && n + nl < io->max_units && v - u < 16ull * io->max_units; v++) {
            if (!(__atomic_load_n(&p->flags[v], __ATOMIC_ACQUIRE) & UF_HAS_DATA)) continue; /* zeros already */
            uint8_t s = __atomic_load_n(&p->state[v], __ATOMIC_RELAXED); /* a hint: read_resident checks */
            if (s == U_CLEAN || s == U_DIRTY) {
                lunits[nl++] = v;
                continue;
            }
            step_seg(p, io, n++, v, e->first_unit);
        }
        uint32_t got = nl ? read_resident(p, lunits, nl, lbuf) : 0;
        for (uint32_t i = got; i < nl; i++) step_seg(p, io, n++, lunits[i], e->first_unit); /* gone meanwhile */
        for (uint32_t i = 0; i < got; i++) {
            loffs[i] = (lunits[i] - e->first_unit) * p->unit;
            llens[i] = (uint32_t)p->unit;
        }
        if (n) rc = read_any(p, io, idx, n, idx + u, &target);
        if (rc == DLS_OK && (n || got)) {
            dls_ep *conn = pg_io_conn(p, io, ep);
            rc = DLS_E_IO;
            if (conn) {
                dls_batch fromcopy = {.slab = slab, .token = target.token, .nseg = n, .offs = io->offs,
                                      .lens = io->lens, .buf = io->bounce, .flags = 0, .crcs = io->crcs,
                                      .timeout_ms = p->cfg.io_timeout_ms, .bad_seg = -1};
                dls_batch frommem = fromcopy;
                frommem.nseg = got, frommem.offs = loffs, frommem.lens = llens, frommem.buf = lbuf;
                frommem.crcs = NULL;
                dls_ep *eps[2] = {conn, conn};
                dls_batch *bs[2] = {&fromcopy, &frommem};
                int rcs[2] = {DLS_OK, DLS_OK};
                int k = (n ? 0 : 1), nb = (n ? 1 : 0) + (got ? 1 : 0);
                dls_ep_write_many(eps + k, bs + k, nb, rcs + k);
                rc = rcs[0] != DLS_OK ? rcs[0] : rcs[1];
            }
            if (rc == DLS_OK) {
                PG_ADD(p, bytes_written, (uint64_t)(n + got) * p->unit);
                PG_ADD(p, rebuild_resident_bytes, (uint64_t)got * p->unit);
            }
        }
        pthread_mutex_unlock(&e->io);
        u = v;
        copied += (uint64_t)(n + got) * p->unit;
        if (bytes_per_s && (n || got) && rc == DLS_OK) pace(p, t0, copied, bytes_per_s);
    }
    free(lunits), free(loffs), free(llens), free(lbuf);
    pg_io_free(io);
    return rc;
}
