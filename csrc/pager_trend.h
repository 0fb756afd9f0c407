#ifndef DLSHARE_PAGER_TREND_H
#define DLSHARE_PAGER_TREND_H
/* Sequential-access detection for the region engine, pure (no I/O, no locks).
 *
 * The idea is Leap's (Al Maruf and Chowdhury, "Effectively Prefetching Remote
 * Memory with Leap", USENIX ATC 2020): keep the recent faulting units, find
 * the majority stride among their deltas with a Boyer-Moore vote over a
 * window that doubles until a majority appears, and prefetch along it, an
 * eighth of the maximum depth at first.  Units
 * are only seen when they fault, so once a stream is running a fault inside
 * or just past the window it asked for means "keep going": the depth doubles
 * (up to the caller's maximum).  Any other fault ends the stream and falls back
 * to the vote over the faults from that one on (inside a stream, faults land
 * where the prefetch runs end, which says nothing of the reader's stride). */
#include <stdint.h>

#define DLS_TREND_HIST 16      /* faults remembered */
#define DLS_TREND_MAX_STRIDE 8 /* larger strides are not streams worth prefetching */

typedef struct dls_trend {
    int64_t hist[DLS_TREND_HIST];
    uint32_t n, pos;  /* faults held, next slot */
    int64_t stride;   /* of the running stream, 0 for none */
    int64_t lo, next; /* the stream's latest fault, and the first unit not asked for yet */
    uint32_t depth;   /* units the stream runs ahead */
} dls_trend;

void dls_trend_init(dls_trend *t);
/* Record a fault on `unit`; returns how many units to prefetch: *first, *first + *stride, ... */
uint32_t dls_trend_fault(dls_trend *t, int64_t unit, uint32_t max_depth, int64_t *first, int64_t *stride);
/* 1 when a fault on `unit` continues the running stream (it falls in or just past its window). */
int dls_trend_follows(const dls_trend *t, int64_t unit);
/* Only the units before `next` were asked for after all: the stream goes on from there. */
void dls_trend_cut(dls_trend *t, int64_t next);
/* The majority delta among the last `window` deltas, 0 when there is none. */
int64_t dls_trend_majority(const dls_trend *t, uint32_t window);
#endif
