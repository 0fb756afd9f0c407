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

int pg_write_back(dls_pager *p, pg_io *io, const uint64_t *units, uint32_t n, uint8_t *from) {
    uint32_t idx;
    pg_extent *e = pg_extent_of(p, units[0], &idx);
    uint8_t *buf = from ? from : io->bounce;
    pthread_mutex_lock(&e->io);
    for (uint32_t i = 0; i < n; i++) {
        /* write-protected by the caller, or moved out of the mapping (`from`): these bytes cannot change */
        if (!from) memcpy(io->bounce + (size_t)i * p->unit, pg_addr(p, units[i]), p->unit);
        io->crcs[i] = dls_crc32c_pages(0, buf + (size_t)i * p->unit, p->unit);
        io->offs[i] = (units[i] - e->first_unit) * p->unit;
        io->lens[i] = (uint32_t)p->unit;
    }
    pg_copy cs[DLS_PAGER_MAX_COPIES];
    uint32_t nc = pg_copies(e, cs);
    uint32_t durable = 0, sent = 0;
    /* every copy at once: n copies cost about one round trip, not n */
    dls_ep *eps[DLS_PAGER_MAX_COPIES];
    dls_batch bs[DLS_PAGER_MAX_COPIES], *bp[DLS_PAGER_MAX_COPIES];
    int rcs[DLS_PAGER_MAX_COPIES], which[DLS_PAGER_MAX_COPIES], m = 0;
    for (uint32_t k = 0; k < nc; k++) {
        pg_copy *c = &cs[k];
        if (c->failed || p->closing) continue;
        dls_ep *conn = pg_io_conn(p, io, c->ep);
        if (!conn) {
            pg_copy_failed(p, idx, c, DLS_E_IO);
            continue;
        }
        bs[m] = (dls_batch){.slab = c->slab, .token = c->token, .nseg = n, .offs = io->offs, .lens = io->lens,
                            .buf = buf, .flags = 0, .crcs = NULL, .timeout_ms = p->cfg.io_timeout_ms,
                            .bad_seg = -1};
        bp[m] = &bs[m];
        eps[m] = conn;
        which[m++] = (int)k;
    }
    if (m) dls_ep_write_many(eps, bp, m, rcs);
    for (int i = 0; i < m; i++) {
        pg_copy *c = &cs[which[i]];
        if (rcs[i] < 0) pg_io_drop(io, c->ep);
        if (rcs[i]) {
            pg_copy_failed(p, idx, c, rcs[i]);
            continue;
        }
        sent++;
        if (c->role == DLS_COPY_LIVE || c->role == DLS_COPY_EVICTING) durable++;
    }
    if (durable) {
        for (uint32_t i = 0; i < n; i++) {
            pg_lock(p, units[i]);
            __atomic_store_n(&p->crc[units[i]], io->crcs[i], __ATOMIC_RELAXED);
            __atomic_or_fetch(&p->flags[units[i]], UF_HAS_DATA, __ATOMIC_RELEASE);
            pg_unlock(p, units[i]);
        }
        PG_ADD(p, written_back_units, n);
        PG_ADD(p, bytes_written, (uint64_t)n * p->unit * sent);
    }
    pthread_mutex_unlock(&e->io);
    return durable ? DLS_OK : DLS_E_IO;
}

int pg_copy_extent(dls_pager *p, uint32_t idx, int32_t ep, uint32_t slab, const uint8_t *token) {
    if (idx >= p->next) return DLS_E_ARG;
    pg_extent *e = &p->ext[idx];
    pg_io *io = pg_io_new(p);
    if (!io) return -ENOMEM;
    pg_copy target = {.ep = ep, .slab = slab, .role = DLS_COPY_REBUILDING};
    memcpy(target.token, token, 16);
    int rc = DLS_OK;
    uint64_t end = e->first_unit + e->nunits;
    for (uint64_t u = e->first_unit; u < end && rc == DLS_OK;) {
        if (p->closing) {
            rc = DLS_E_CLOSED;
            break;
        }
        /* one step under the extent's io lock: no write-back lands between our read and our write */
        pthread_mutex_lock(&e->io);
        uint32_t n = 0;
        uint64_t v = u;
        for (; v < end && n < io->max_units && v - u < 16ull * io->max_units; v++) {
            if (!(__atomic_load_n(&p->flags[v], __ATOMIC_ACQUIRE) & UF_HAS_DATA)) continue; /* zeros already */
            io->units[n] = v;
            io->offs[n] = (v - e->first_unit) * p->unit;
            io->lens[n] = (uint32_t)p->unit;
            n++;
        }
        if (n) {
            rc = read_any(p, io, idx, n, idx + u, &target);
            if (rc == DLS_OK) {
                dls_ep *conn = pg_io_conn(p, io, ep);
                rc = DLS_E_IO;
                if (conn) {
                    dls_batch b = {.slab = slab, .token = target.token, .nseg = n, .offs = io->offs,
                                   .lens = io->lens, .buf = io->bounce, .flags = 0, .crcs = io->crcs,
                                   .timeout_ms = p->cfg.io_timeout_ms, .bad_seg = -1};
                    rc = dls_ep_write(conn, &b);
                }
                if (rc == DLS_OK) PG_ADD(p, bytes_written, (uint64_t)n * p->unit);
            }
        }
        pthread_mutex_unlock(&e->io);
        u = v;
    }
    pg_io_free(io);
    return rc;
}
