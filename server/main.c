/*
 * main.c: kvtierd's entry point. It reads the settings (embedded defaults, then --config FILE,
 * then flags), opens the daemon, prints the addresses it serves, runs the loop until SIGTERM or
 * SIGINT, and maps the outcome to an exit status:
 *   0   clean shutdown after a signal
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
 * the process, the index's included (glibc's malloc tunables do nothing here). jemalloc reads
 * this once, at its first allocation; MALLOC_CONF in the environment overrides it (thp:never to
 * opt out). thp:always makes it advise transparent huge pages on the memory it maps for its
 * arenas: the index is hundreds of MiB of nodes walked in no particular order, so on 4 KiB pages
 * nearly every node a MATCH visits costs a TLB miss. Measured with bench_server's MATCH over the
 * conversation trace, three alternating runs against MALLOC_CONF=thp:never: kvtierd CPU per MATCH
 * 2.64-3.06 us against 2.80-3.28 on the Unix socket, 2.47-2.68 against 2.72-2.76 over TCP. The
 * DRAM tier's arena maps its own region (tiers/dram.c): this does not touch it.
 */
const char *malloc_conf = "thp:always,metadata_thp:auto";

int main(int argc, char **argv)
{
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
    rc = kvt__srv_run(s);
    kvt__srv_close(s);
    kvt__conf_free(&conf);
    if (rc < 0)
        return 70;
    kvt_log(KVT_LOG_INFO, "kvtierd: stopped");
    return 0;
}
