/* Timed inside a box by bench/monitor.sh: nanoseconds per getppid (the
 * call the monitors there subscribe to) and per 1-byte read+write pair
 * (calls nobody subscribes to), each the best of 5 batches.
 * Usage: monitor-work CALLS PAIRS; prints "getppid_ns rw_ns". */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    long calls = atol(argv[1]), pairs = atol(argv[2]);
    double best_p = 1e18, best_rw = 1e18;
    int src = open("/dev/zero", O_RDONLY), dst = open("/dev/null", O_WRONLY);
    char b;
    for (int round = 0; round < 5; round++) {
        double t = now_ns();
        for (long i = 0; i < calls; i++)
            getppid();
        double p = (now_ns() - t) / calls;
        t = now_ns();
        for (long i = 0; i < pairs; i++) {
            if (read(src, &b, 1) != 1 || write(dst, &b, 1) != 1)
                return 1;
        }
        double rw = (now_ns() - t) / pairs;
        if (p < best_p) best_p = p;
        if (rw < best_rw) best_rw = rw;
    }
    printf("%.0f %.0f\n", best_p, best_rw);
    return 0;
}
