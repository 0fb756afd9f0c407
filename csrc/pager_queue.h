#ifndef DLSHARE_PAGER_QUEUE_H
#define DLSHARE_PAGER_QUEUE_H
/* The region engine's queues (internal: pager*.c only).  The fault side hands the eviction side the
 * units it installed (pg_ring_add), and the eviction side hands the fault side a unit faulted while
 * it went (pg_queue_demand): both go through here, so neither side calls the other. */
#include <stdint.h>

#include "pager_core.h"

/* A ring of unit numbers; the caller holds the lock that guards it.  0 or -errno. */
int pg_queue_init(pg_queue *q, uint64_t cap);
void pg_queue_free(pg_queue *q);
/* Grows rather than drops (a dropped fault would hang its thread): 0, or -ENOMEM. */
int pg_queue_push(pg_queue *q, uint32_t v);
/* 0, or -EAGAIN when the queue is empty. */
int pg_queue_pop(pg_queue *q, uint32_t *v);
int pg_queue_peek(const pg_queue *q, uint32_t *v);

/* Queue unit u for a fetch (it must be FETCHING and UF_QUEUED, set by the caller under its lock).
 * Out of memory, the unit goes back to ABSENT and its waiters are woken to fault again (reported). */
void pg_queue_demand(dls_pager *p, uint64_t u);
/* An installed unit becomes an eviction candidate (the ring, or a stream's young queue). */
void pg_ring_add(dls_pager *p, uint64_t u);
/* Under ring_mu: u (UF_INRING) back on the ring; out of memory it leaves the ring (reported). */
void pg_ring_push_locked(dls_pager *p, uint64_t u);
#endif
