/*
 * main.c: kvtierd's entry point. It reads the settings (embedded defaults, then --config FILE,
 * then flags), opens the daemon, prints the addresses it serves (and tells systemd it is ready
 * when started as a Type=notify service), runs the loop until SIGTERM or SIGINT or the end of a
 * drain (SIGUSR1), and maps the outcome to an exit status:
 *   0   clean shutdown after a signal, or a drain finished
 *   64  bad command line or configuration (EX_USAGE)
 *   69  a tier or socket could not be set up (EX_UNAVAILABLE: port in use, disk full, ...)
 *   70  the loop failed (EX_SOFTWARE)
 */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>

#include "server.h"

#include "config.h" /* KVT_VERSION */

/*
 * kvtierd's malloc is jemalloc: the DRAM tier links it, and it then serves every allocation of
 * the process, the index's included (glibc's malloc tunables do nothing here). Its heap follows
 * the kernel's transparent huge page setting: nothing is advised, so on the usual "madvise"
 * kernels the index is on 4 KiB pages. MALLOC_CONF=thp:always in the environment opts in. It
 * was the default until measured both ways (README, "The radix index"): bench_index_pauses took
 * 317-352 of 2.2 million inserts over 1 ms with it (huge pages faulted in and compacted for in
 * the event loop; the longest 37-43 ms, the 99.99th percentile 4.6-4.7 ms) and 0-3 without
 * (0.07-0.12 ms), while bench_server's MATCH gained nothing above the noise from it (kvtierd CPU
 * per MATCH 2.69-3.14 us against 2.73-2.95 on the Unix socket, 2.45-2.92 against 2.32-3.24 over
 * TCP, alternating runs). The DRAM tier's region asks for huge pages itself (tiers/dram.c): its
 * faults come once per slice of a fixed region, not as the index grows.
 */
int main(int argc, char **argv)
{
    /* Before anything else: libraries start threads of their own (the CUDA runtime does while
     * the HBM tier opens, and the DRAM tier's pinning asks it first), and each inherits the mask
     * of the thread that starts it. Blocked from here on, SIGTERM, SIGINT, SIGHUP and SIGUSR1
     * reach only the loop's signalfd; one that arrives during start-up waits there
     * (server/loop.c). */
    if (kvt__srv_block_signals() < 0) {
        fprintf(stderr, "kvtierd: cannot block SIGTERM, SIGINT, SIGHUP and SIGUSR1\n");
        return 70;
    }
    kvt_srv_conf_t conf;
    char err[512] = "";
    if (kvt__conf_defaults(&conf) < 0) {
        fprintf(stderr, "kvtierd: out of memory\n");
        return 70;
    }
    int rc = kvt__conf_args(&conf, argc, argv, err, sizeof err);
    if (rc == 1) {
        kvt__conf_free(&conf);
        return 0;
    }
    if (rc == 0)
        rc = kvt__conf_finish(&conf, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "kvtierd: %s\n", err[0] ? err : kvt_strerror(rc));
        kvt__conf_free(&conf);
        return 64;
    }
    kvt__conf_apply_log(&conf);
    const char *thp = NULL;
    size_t sz = sizeof thp;
    if (mallctl("opt.thp", &thp, &sz, NULL, 0) == 0 && thp)
        kvt_log(KVT_LOG_INFO, "kvtierd: heap: jemalloc, transparent huge pages %s", thp);
    kvt_srv_t *s;
    rc = kvt__srv_open(&s, &conf);
    if (rc < 0) {
        kvt_log(KVT_LOG_ERROR, "kvtierd: not started: %s", kvt_strerror(rc));
        kvt__conf_free(&conf);
        return 69;
    }
    kvt_log(KVT_LOG_INFO, "kvtierd %s%s%s: serving", KVT_VERSION, conf.config ? " config " : "",
            conf.config ? conf.config : "");
    /* The addresses on stdout, one per line, so that scripts (and the tests) can read them. */
    if (s->unix_path[0])
        printf("unix %s\n", s->unix_path);
    if (s->tcp_addr[0])
        printf("tcp %s\n", s->tcp_addr);
    if (s->http_addr[0])
        printf("metrics http://%s/metrics\n", s->http_addr);
    printf("ready\n");
    fflush(stdout);
    kvt__srv_notify("READY=1");
    rc = kvt__srv_run(s);
    kvt__srv_close(s);
    kvt__conf_free(&conf);
    if (rc < 0)
        return 70;
    kvt_log(KVT_LOG_INFO, "kvtierd: stopped");
    return 0;
}
