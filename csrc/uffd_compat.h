/* userfaultfd definitions newer than the uapi headers of the build machine (Debian 12's are 6.1); the
 * kernel that runs the code says whether it has them (UFFDIO_API features, UFFDIO_REGISTER ioctls). */
#ifndef DLS_UFFD_COMPAT_H
#define DLS_UFFD_COMPAT_H

#include <linux/userfaultfd.h>
#include <stdint.h>

#ifndef UFFDIO_MOVE /* Linux 6.8 */
struct uffdio_move {
    uint64_t dst, src, len, mode;
    int64_t move;
};
#define UFFDIO_MOVE _IOWR(UFFDIO, 0x05, struct uffdio_move)
#define UFFDIO_MOVE_MODE_DONTWAKE ((uint64_t)1 << 0)
#define UFFD_FEATURE_MOVE (1 << 16)
#define _UFFDIO_MOVE 0x05
#endif

#endif
