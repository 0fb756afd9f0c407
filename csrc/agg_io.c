/* Whole-message socket I/O for the aggregation server and client (see agg_io.h). */
#include "agg_io.h"

#include <errno.h>
#include <poll.h>
#include <time.h>
#include <sys/time.h>
#include <sys/socket.h>
#include <sys/uio.h>

static long send2(int fd, const void *a, size_t alen, const void *b, size_t blen, int flags) {
    struct iovec iov[2] = {{(void *)a, alen}, {(void *)b, blen}};
    struct msghdr msg = {0};
    size_t total = alen + blen, sent = 0;
    int first = 0;
    while (first < 2 && iov[first].iov_len == 0) first++;
    while (sent < total) {
        msg.msg_iov = iov + first;
        msg.msg_iovlen = 2 - first;
        ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
        if (k < 0) {
            if (errno == EINTR) continue;
            if ((flags & MSG_DONTWAIT) && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            return -errno;
        }
        sent += (size_t)k;
        size_t left = (size_t)k;
        while (left && first < 2) { /* advance the iovecs past what went out */
            if (left >= iov[first].iov_len) {
                left -= iov[first].iov_len;
                iov[first].iov_len = 0;
                first++;
            } else {
                iov[first].iov_base = (char *)iov[first].iov_base + left;
                iov[first].iov_len -= left;
                left = 0;
            }
        }
        while (first < 2 && iov[first].iov_len == 0) first++;
    }
    return (long)sent;
}

long dls_agg_send2(int fd, const void *a, size_t alen, const void *b, size_t blen) {
    return send2(fd, a, alen, b, blen, 0);
}

long dls_agg_send2_nowait(int fd, const void *a, size_t alen, const void *b, size_t blen) {
    return send2(fd, a, alen, b, blen, MSG_DONTWAIT);
}

long dls_agg_recv_exact(int fd, void *buf, size_t len) {
    size_t got = 0;
    while (got < len) {
        ssize_t k = recv(fd, (char *)buf + got, len - got, MSG_WAITALL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (k == 0) return got == 0 ? 0 : -ECONNRESET;
        got += (size_t)k;
    }
    return (long)got;
}

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

long dls_agg_recv_deadline(int fd, void *buf, size_t len, int wait_ms, int timeout_ms) {
    if (wait_ms >= 0) {
        struct pollfd p = {fd, POLLIN, 0};
        int r;
        do r = poll(&p, 1, wait_ms); while (r < 0 && errno == EINTR);
        if (r < 0) return -errno;
        if (r == 0) return -EAGAIN;
    }
    long deadline = now_ms() + timeout_ms;
    size_t got = 0;
    while (got < len) {
        long left = deadline - now_ms();
        if (left <= 0) return -ETIMEDOUT;
        /* SO_RCVTIMEO bounds one recv in total, even with MSG_WAITALL, so the whole message
         * ends by the deadline however the peer trickles it. */
        struct timeval tv = {left / 1000, (left % 1000) * 1000};
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0) return -errno;
        ssize_t k = recv(fd, (char *)buf + got, len - got, MSG_WAITALL);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return -ETIMEDOUT;
            return -errno;
        }
        if (k == 0) return got == 0 ? 0 : -ECONNRESET;
        got += (size_t)k;
    }
    return (long)got;
}
