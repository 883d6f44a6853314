/*
 * fuzz_conf.c: libFuzzer harness for kvtierd's settings (server/conf.c): the input is read as a
 * configuration file ("name = value" lines, quotes, comments), and its lines are also applied as
 * command-line arguments; then the final checks run. A refused input must leave an error
 * message; nothing may leak, whatever was set before the refusal. The file is a memfd, read
 * through its /proc path. Settings that read other files (config, secret-file) are left out of
 * the final checks: the input names arbitrary paths.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "conf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* The final checks set the log level the input names: set back to nothing after each. */
static void quiet(void)
{
    kvt_log_set_level((kvt_log_level_t)(KVT_LOG_ERROR + 1));
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    quiet();
    return 0;
}

static void from_file(const uint8_t *data, size_t size)
{
    int fd = memfd_create("kvtierd.conf", MFD_CLOEXEC);
    if (fd < 0 || write(fd, data, size) != (ssize_t)size) {
        if (fd >= 0)
            close(fd);
        return;
    }
    char path[64], err[512] = "";
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    kvt_srv_conf_t c;
    if (kvt__conf_defaults(&c) == 0) {
        int rc = kvt__conf_load(&c, path, err, sizeof err);
        if (rc < 0 && !err[0])
            abort(); /* a refusal says why */
        if (rc == 0 && !*c.secret_file) {
            err[0] = 0;
            if (kvt__conf_finish(&c, err, sizeof err) < 0 && !err[0])
                abort();
            quiet();
        }
        kvt__conf_free(&c);
    }
    close(fd);
}

/* Each line of the input as one argument (the first is the program's name). */
static void from_args(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1), *argv[65];
    if (!text)
        return;
    memcpy(text, data, size);
    text[size] = 0;
    int argc = 0;
    argv[argc++] = "kvtierd";
    for (char *save = NULL, *a = strtok_r(text, "\n", &save); a && argc < 64;
         a = strtok_r(NULL, "\n", &save)) {
        /* No file reads (--config), no usage text on stdout (--help, --version). */
        if (strstr(a, "config") || !strcmp(a, "--help") || !strcmp(a, "-h") ||
            !strcmp(a, "--version"))
            continue;
        argv[argc++] = a;
    }
    argv[argc] = NULL;
    kvt_srv_conf_t c;
    char err[512] = "";
    if (kvt__conf_defaults(&c) == 0) {
        int rc = kvt__conf_args(&c, argc, argv, err, sizeof err);
        if (rc < 0 && !err[0])
            abort();
        if (rc == 0 && !*c.secret_file) {
            err[0] = 0;
            if (kvt__conf_finish(&c, err, sizeof err) < 0 && !err[0])
                abort();
            quiet();
        }
        kvt__conf_free(&c);
    }
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 64 << 10)
        return 0;
    from_file(data, size);
    from_args(data, size);
    return 0;
}
