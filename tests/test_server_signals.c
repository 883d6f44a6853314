/*
 * test_server_signals.c: kvtierd's signals on every thread it has. The daemon takes SIGTERM,
 * SIGINT, SIGHUP and SIGUSR1 through its loop's signalfd, which works only while no thread of the
 * process leaves them open: the kernel hands a process-directed signal to any thread that does not
 * block it, and its default action then ends the whole process with no clean shutdown. Libraries
 * start threads of their own (the CUDA runtime does while the HBM tier opens), so the daemon blocks
 * the three signals first thing in main. These tests read every thread's SigBlk from
 * /proc/PID/task/TID/status of a daemon with every tier this machine can give it (a GPU's only
 * where one is usable: without one the daemon has a single thread, and the check is there for
 * GPU hosts), and send a SIGTERM during start-up, before the loop runs, which must end the
 * daemon cleanly once it does.
 */
#include "test_server_harness.h"

#include <dirent.h>
#include <sys/time.h>

#include "tier.h"

/* Bit n-1 of SigBlk is signal n. */
#define SIGMASK(sig) (1ull << ((sig)-1))

/* Checks that every thread of pid blocks SIGTERM, SIGINT, SIGHUP and SIGUSR1; returns how many
 * threads it has. A status without a SigBlk line fails: a check that cannot see the mask proves
 * nothing. */
static int check_threads_block(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *dir = opendir(path);
    cr_assert(dir, "%s: %s", path, strerror(errno));
    int threads = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (e->d_name[0] == '.')
            continue;
        char st[400];
        snprintf(st, sizeof st, "%s/%s/status", path, e->d_name);
        FILE *f = fopen(st, "r");
        if (!f && errno == ENOENT)
            continue; /* the thread has just ended */
        cr_assert(f, "%s: %s", st, strerror(errno));
        char line[256], name[64] = "?";
        unsigned long long blk = 0;
        int found = 0;
        while (fgets(line, sizeof line, f)) {
            if (!strncmp(line, "Name:", 5))
                sscanf(line + 5, " %63[^\n]", name);
            if (!strncmp(line, "SigBlk:", 7))
                found = sscanf(line + 7, " %llx", &blk) == 1;
        }
        fclose(f);
        cr_assert(found, "%s has no SigBlk line: the thread's mask cannot be checked", st);
        unsigned long long want =
            SIGMASK(SIGTERM) | SIGMASK(SIGINT) | SIGMASK(SIGHUP) | SIGMASK(SIGUSR1);
        cr_expect_eq(
            blk & want, want,
            "thread %s (%s) leaves SIGTERM, SIGINT, SIGHUP or SIGUSR1 open (SigBlk %016llx): "
            "one sent to the daemon may end it by its default action",
            e->d_name, name, blk);
        fprintf(stderr, "kvtierd thread %s (%s): SigBlk %016llx\n", e->d_name, name, blk);
        threads++;
    }
    closedir(dir);
    cr_assert_gt(threads, 0, "no thread listed in %s", path);
    return threads;
}

static void check_and_stop(kvd_t *d, const char *what)
{
    /* A request through every tier first: a tier that starts threads lazily has them now. */
    kvt_client_t *c = kvd_client(d, "sig", 16, 4096);
    uint32_t tok[64];
    kvd_tokens(tok, 64, 3);
    uint8_t buf[4 * 4096];
    kvd_fill(buf, sizeof buf, 1);
    kvt_client_put_t r;
    cr_assert_eq(kvt_client_put(c, tok, 64, 0, 4, buf, NULL, &r), 0);
    cr_expect_eq(r.stored, 4);
    cr_expect_eq(kvt_client_ping(c, NULL), 0);
    int n = check_threads_block(d->pid);
    fprintf(stderr,
            "%s: kvtierd runs %d thread(s), each blocking SIGTERM, SIGINT, SIGHUP and SIGUSR1\n",
            what, n);
    kvt_client_close(c);
    int rc = kvd_stop(d);
    if (rc != 0)
        kvd_log_tail(d, 2000);
    cr_expect_eq(rc, 0, "SIGTERM: exit status %d, not a clean shutdown", rc);
    char log[65536];
    kvd_slurp(d, "kvtierd.log", log, sizeof log);
    cr_expect(strstr(log, "kvtierd: stopped"), "no \"stopped\" line in the log");
    kvd_cleanup(d);
}

Test(server_signals, every_thread_blocks_them_with_every_tier_but_a_gpu)
{
    kvd_t d = {0};
    const char *redis = getenv("KVT_TEST_REDIS");
    const char *flags[16] = {"--hbm-backend", "host", "--hbm-bytes", "4M", "--log-level", "info"};
    int n = 6;
    if (redis && *redis) {
        flags[n++] = "--remote";
        flags[n++] = redis;
    } else {
        fprintf(stderr, "server_signals: KVT_TEST_REDIS is not set: no remote tier in this run\n");
    }
    flags[n] = NULL;
    kvd_startv(&d, flags);
    check_and_stop(&d, n > 6 ? "hbm (host), dram, nvme, remote" : "hbm (host), dram, nvme");
}

Test(server_signals, every_thread_blocks_them_with_the_cuda_hbm_tier)
{
    if (!kvt_tier_cuda_usable()) {
        /* Criterion prints a skip's reason only with --verbose: say it on stderr too. */
        fprintf(stderr, "SKIP server_signals::every_thread_blocks_them_with_the_cuda_hbm_tier: "
                        "no usable CUDA device (or no CUDA in this build)\n");
        cr_skip_test("no usable CUDA device (or no CUDA in this build)");
    }
    kvd_t d = {0};
    kvd_start(&d, "--hbm-backend", "cuda", "--hbm-bytes", "64M", "--log-level", "info", NULL);
    check_and_stop(&d, "hbm (cuda), dram pinned, nvme");
}

Test(server_signals, sigterm_during_start_up_ends_it_cleanly)
{
    /* The daemon's configuration file is a FIFO: reading it, start-up waits until this test has
     * opened the other end (so the daemon is past the top of main, as deterministic as a slow
     * NVMe recovery or pinning and quicker), then gets a SIGTERM before its loop exists. It must
     * then finish starting, read the pending signal on its loop's first turn and exit 0. */
    kvd_t d = {0};
    kvd_mkdir(&d);
    char fifo[600], log[600];
    snprintf(fifo, sizeof fifo, "%s/kvtierd.conf", d.dir);
    snprintf(log, sizeof log, "%s/kvtierd.log", d.dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0, "mkfifo: %s", strerror(errno));
    const char *argv[] = {kvd_binary(),
                          "--config",
                          "kvtierd.conf",
                          "--tcp",
                          "127.0.0.1:0",
                          "--metrics",
                          "",
                          "--dram-bytes",
                          "16M",
                          "--nvme-bytes",
                          "8M",
                          "--nvme-segment-bytes",
                          "1M",
                          "--hbm-bytes",
                          "0",
                          NULL};
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (chdir(d.dir) < 0)
            _exit(127);
        int lfd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        int nul = open("/dev/null", O_WRONLY);
        if (lfd < 0 || nul < 0)
            _exit(127);
        dup2(nul, 1);
        dup2(lfd, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    cr_assert(pid > 0, "fork: %s", strerror(errno));
    /* A writer's non-blocking open succeeds only once a reader has the FIFO open. */
    int wfd = -1;
    uint64_t deadline = kvt_now_ns() + 20ull * 1000000000ull;
    while ((wfd = open(fifo, O_WRONLY | O_NONBLOCK)) < 0 && errno == ENXIO &&
           kvt_now_ns() < deadline)
        usleep(1000);
    if (wfd < 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        cr_assert_fail("kvtierd never opened its configuration file: %s", strerror(errno));
    }
    cr_assert_eq(kill(pid, SIGTERM), 0);
    const char text[] = "# written after the SIGTERM\nlog-level = info\n";
    cr_assert_eq(write(wfd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
    close(wfd);
    int st = 0;
    pid_t w;
    while ((w = waitpid(pid, &st, WNOHANG)) == 0 && kvt_now_ns() < deadline)
        usleep(2000);
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        kvd_log_tail(&d, 2000);
        cr_assert_fail("kvtierd did not exit within 20 s of a SIGTERM during start-up");
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        kvd_log_tail(&d, 2000);
    cr_expect(!WIFSIGNALED(st), "kvtierd was killed by signal %d during start-up",
              WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d, not a clean shutdown",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    char text_log[65536];
    kvd_slurp(&d, "kvtierd.log", text_log, sizeof text_log);
    cr_expect(strstr(text_log, "SIGTERM received, shutting down"), "%s", text_log);
    cr_expect(strstr(text_log, "kvtierd: stopped"), "%s", text_log);
    kvd_rmrf(d.dir);
}
