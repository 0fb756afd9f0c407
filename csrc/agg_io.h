#ifndef DLSHARE_AGG_IO_H
#define DLSHARE_AGG_IO_H
#include <stddef.h>

/* Blocking socket I/O for the aggregation data path, called with the GIL released, so that
 * a whole message costs one GIL release instead of one per partial send or receive. */

/* Send a then b (either may be empty) completely on blocking socket fd.
 * Returns the bytes sent, or -errno. */
long dls_agg_send2(int fd, const void *a, size_t alen, const void *b, size_t blen);
/* As dls_agg_send2, but never blocks: returns the bytes sent before the socket's buffer was full
 * (possibly 0), or -errno. */
long dls_agg_send2_nowait(int fd, const void *a, size_t alen, const void *b, size_t blen);
/* Receive exactly len bytes.  Returns len, 0 on EOF before the first byte, -errno on an
 * error, or -ECONNRESET when the peer closed mid-message. */
long dls_agg_recv_exact(int fd, void *buf, size_t len);
/* Receive exactly len bytes within timeout_ms of the first byte (a frame deadline).  With
 * wait_ms >= 0, first wait at most that long for the first byte and return -EAGAIN if none came
 * (the connection is idle; nothing was consumed).  Returns len, 0 on EOF before the first byte,
 * -ETIMEDOUT when the deadline passed mid-message, -ECONNRESET when the peer closed mid-message,
 * or -errno.  Leaves SO_RCVTIMEO set on fd. */
long dls_agg_recv_deadline(int fd, void *buf, size_t len, int wait_ms, int timeout_ms);
#endif
