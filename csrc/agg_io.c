/* Whole-message socket I/O for the aggregation server and client (see agg_io.h). */
#include "agg_io.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

long dls_agg_send2(int fd, const void *a, size_t alen, const void *b, size_t blen) {
    struct iovec iov[2] = {{(void *)a, alen}, {(void *)b, blen}};
    struct msghdr msg = {0};
    size_t total = alen + blen, sent = 0;
    int first = 0;
    while (sent < total) {
        msg.msg_iov = iov + first;
        msg.msg_iovlen = 2 - first;
        ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
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
