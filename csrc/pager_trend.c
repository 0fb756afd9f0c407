/* Sequential-access detection; see pager_trend.h. */
#include "pager_trend.h"

#include <string.h>

void dls_trend_init(dls_trend *t) { memset(t, 0, sizeof *t); }

static int64_t delta_at(const dls_trend *t, uint32_t k) {
    /* k-th most recent delta (0 = newest): hist[newest - k] - hist[newest - k - 1] */
    uint32_t a = (t->pos + DLS_TREND_HIST - 1 - k) % DLS_TREND_HIST;
    uint32_t b = (a + DLS_TREND_HIST - 1) % DLS_TREND_HIST;
    return t->hist[a] - t->hist[b];
}

int64_t dls_trend_majority(const dls_trend *t, uint32_t window) {
    uint32_t have = t->n ? t->n - 1 : 0;
    if (window > have) window = have;
    if (window < 2) return 0;
    int64_t cand = 0;
    uint32_t votes = 0;
    for (uint32_t k = 0; k < window; k++) {
        int64_t d = delta_at(t, k);
        if (votes == 0) {
            cand = d;
            votes = 1;
        } else if (d == cand) {
            votes++;
        } else {
            votes--;
        }
    }
    uint32_t count = 0;
    for (uint32_t k = 0; k < window; k++) count += delta_at(t, k) == cand;
    return count * 2 > window ? cand : 0;
}

static int in_stream(const dls_trend *t, int64_t unit) {
    if (t->stride > 0) return unit >= t->lo && unit <= t->next + t->stride;
    return unit <= t->lo && unit >= t->next + t->stride;
}

int dls_trend_follows(const dls_trend *t, int64_t unit) { return t->stride != 0 && in_stream(t, unit); }

uint32_t dls_trend_fault(dls_trend *t, int64_t unit, uint32_t max_depth, int64_t *first, int64_t *stride) {
    if (t->stride != 0 && !in_stream(t, unit)) {
        /* The reader left its stream.  The faults remembered from inside it fell where the prefetch runs
         * ended (every 8 units for 16 KiB units in 128 KiB runs), a spacing the vote would take for the
         * reader's stride: start over, as at the first fault. */
        t->n = 0;
        t->pos = 0;
    }
    t->hist[t->pos] = unit;
    t->pos = (t->pos + 1) % DLS_TREND_HIST;
    if (t->n < DLS_TREND_HIST) t->n++;
    *first = 0;
    *stride = 0;
    if (max_depth == 0) return 0;
    if (t->stride != 0 && in_stream(t, unit)) {
        /* the stream goes on: run further ahead */
        uint32_t d = t->depth * 2;
        t->depth = d > max_depth ? max_depth : (d < 2 ? 2 : d);
        int64_t s = t->stride;
        int64_t target = unit + s * (int64_t)t->depth;
        int64_t from = s > 0 ? (t->next > unit + s ? t->next : unit + s) : (t->next < unit + s ? t->next : unit + s);
        int64_t span = (target - from) / s;
        if (span < 0) return 0;
        uint32_t count = (uint32_t)span + 1;
        t->lo = unit; /* the stream is here now: what lies behind is done */
        t->next = from + s * (int64_t)count;
        *first = from;
        *stride = s;
        return count;
    }
    int64_t d = 0;
    for (uint32_t w = 4; ; w *= 2) {
        d = dls_trend_majority(t, w);
        if (d != 0 || w >= DLS_TREND_HIST - 1) break;
    }
    if (d == 0 || d > DLS_TREND_MAX_STRIDE || d < -DLS_TREND_MAX_STRIDE) {
        t->stride = 0;
        t->depth = 0;
        return 0;
    }
    t->stride = d;
    /* start an eighth of the way to the deepest (32 units, one 128 KiB run, at the default 1 MiB of
     * 4 KiB units), at least 2: a reader that jumps to a new chunk gets a run's worth at its second
     * fault instead of doubling up from 2, one stall per doubling */
    uint32_t first_depth = max_depth / 8 > 2 ? max_depth / 8 : 2;
    t->depth = max_depth < first_depth ? max_depth : first_depth;
    t->lo = unit;
    t->next = unit + d + d * (int64_t)t->depth;
    *first = unit + d;
    *stride = d;
    return t->depth;
}

void dls_trend_cut(dls_trend *t, int64_t next) {
    if (t->stride) t->next = next;
}
