/*
 * test_client_batch.c: libkvtier's pipelined batches against the real daemon: a thousand requests
 * in one run (more than the socket buffers hold, so writing and reading must interleave), each
 * with its own status and result; an error in the middle touches only its own entry; a closed
 * daemon makes every later call fail with ECLOSED instead of hanging.
 */
#include "proto.h"
#include "test_server_harness.h"

#define PAGE 16

Test(client_batch, thousand_pipelined_requests)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 512);
    kvt_batch_t *b;
    cr_assert_eq(kvt_batch_create(&b, c), 0);
    enum { N = 500 };
    static uint32_t tok[N][4 * PAGE];
    static uint8_t payload[N][4 * 512];
    static kvt_client_put_t pr[N];
    static kvt_client_match_t mr[N];
    static int pst[N], mst[N], bad_st, ping_st;
    for (int i = 0; i < N; i++) {
        kvd_tokens(tok[i], 4 * PAGE, (uint32_t)i * 1000);
        kvd_fill(payload[i], sizeof payload[i], (uint32_t)i);
        cr_assert_eq(kvt_batch_put(b, tok[i], 4 * PAGE, 0, 4, payload[i], NULL, &pr[i], &pst[i]),
                     0);
    }
    kvt_client_put_t bad;
    /* Payload pages 3..5 of a 4-page request: EINVAL for this entry only. */
    cr_assert_eq(kvt_batch_put(b, tok[0], 4 * PAGE, 3, 2, payload[0], NULL, &bad, &bad_st), 0);
    for (int i = 0; i < N; i++)
        cr_assert_eq(
            kvt_batch_match(b, tok[i], 4 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &mr[i], &mst[i]), 0);
    cr_assert_eq(kvt_batch_ping(b, &ping_st), 0);
    cr_expect_eq(kvt_batch_size(b), 2 * N + 2);
    cr_assert_eq(kvt_batch_run(b), 0);
    cr_expect_eq(kvt_batch_size(b), 0);
    for (int i = 0; i < N; i++) {
        cr_expect_eq(pst[i], 0);
        cr_expect_eq(pr[i].stored, 4);
        cr_expect_eq(mst[i], 0);
        cr_expect_eq(mr[i].pages, 4);
        cr_expect_neq(mr[i].lease, 0);
    }
    cr_expect_eq(bad_st, KVT_CLIENT_EINVAL);
    cr_expect_eq(ping_st, 0);
    /* The leases are real: GET through them, then release them all in one batch. */
    uint8_t back[4 * 512];
    for (int i = 0; i < N; i += 50) {
        cr_assert_eq(kvt_client_get(c, mr[i].lease, 0, 4, back, sizeof back, NULL, NULL), 0);
        cr_expect(memcmp(back, payload[i], sizeof back) == 0);
    }
    static int rst[N];
    for (int i = 0; i < N; i++)
        cr_assert_eq(kvt_batch_release(b, mr[i].lease, &rst[i]), 0);
    cr_assert_eq(kvt_batch_run(b), 0);
    for (int i = 0; i < N; i++)
        cr_expect_eq(rst[i], 0);
    cr_expect_eq(kvd_stat(c, "leases"), 0);
    /* PREFETCHes of pages in DRAM already, with and without START: resident, nothing to move. */
    kvt_client_prefetch_t fr[2];
    int fst[2];
    cr_assert_eq(kvt_batch_prefetch(b, tok[1], 4 * PAGE, KVT_CLIENT_TIER_DRAM, 0, &fr[0], &fst[0]),
                 0);
    cr_assert_eq(
        kvt_batch_prefetch_start(b, tok[2], 4 * PAGE, KVT_CLIENT_TIER_DRAM, 0, &fr[1], &fst[1]), 0);
    cr_assert_eq(kvt_batch_run(b), 0);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(fst[i], 0);
        cr_expect(fr[i].pages == 4 && fr[i].resident == 4 && fr[i].moved == 0 && fr[i].failed == 0,
                  "prefetch %d: %u pages, %u resident, %u moved, %u failed", i, fr[i].pages,
                  fr[i].resident, fr[i].moved, fr[i].failed);
    }
    /* REMOVEs of idle pages, waiting or not: both done; a second one finds nothing. */
    int xst[3];
    cr_assert_eq(kvt_batch_remove(b, tok[1], 4 * PAGE, &xst[0]), 0);
    cr_assert_eq(kvt_batch_remove_nowait(b, tok[2], 4 * PAGE, &xst[1]), 0);
    cr_assert_eq(kvt_batch_remove_nowait(b, tok[2], 4 * PAGE, &xst[2]), 0);
    cr_assert_eq(kvt_batch_run(b), 0);
    cr_expect(xst[0] == 0 && xst[1] == 0 && xst[2] == KVT_CLIENT_ENOENT, "%d %d %d", xst[0], xst[1],
              xst[2]);
    kvt_batch_destroy(b);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

/* Lent payloads (kvt_batch_put_ref) go out from the caller's buffers between the copied frames,
 * in order, and land byte-exact; a frame bigger than the socket buffer goes in several writes. */
Test(client_batch, lent_payloads_go_out_in_order)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    enum { BLK = 256 << 10, N = 6 };
    kvt_client_t *c = kvd_client(&d, "lent", PAGE, BLK);
    kvt_batch_t *b;
    cr_assert_eq(kvt_batch_create(&b, c), 0);
    static uint32_t tok[N][2 * PAGE];
    uint8_t *pay[N];
    kvt_client_put_t pr[N];
    int pst[N], pingst[N];
    for (int i = 0; i < N; i++) {
        kvd_tokens(tok[i], 2 * PAGE, 70000 + (uint32_t)i * 100);
        pay[i] = malloc(2 * BLK);
        kvd_fill(pay[i], 2 * BLK, (uint32_t)i);
        /* Lent and copied frames interleaved: a PING between every two PUTs. */
        cr_assert_eq(kvt_batch_put_ref(b, tok[i], 2 * PAGE, 0, 2, pay[i], NULL, &pr[i], &pst[i]),
                     0);
        cr_assert_eq(kvt_batch_ping(b, &pingst[i]), 0);
    }
    cr_assert_eq(kvt_batch_run(b), 0);
    uint8_t *got = malloc(2 * BLK);
    for (int i = 0; i < N; i++) {
        cr_expect(pst[i] == 0 && pr[i].stored == 2, "put %d: %d, stored %u", i, pst[i],
                  pr[i].stored);
        cr_expect_eq(pingst[i], 0);
        kvt_client_match_t m = {0};
        cr_assert_eq(kvt_client_match(c, tok[i], 2 * PAGE, KVT_CLIENT_LEASE, 0, NULL, &m), 0);
        cr_assert_eq(m.pages, 2);
        cr_assert_eq(kvt_client_get(c, m.lease, 0, 2, got, 2 * BLK, NULL, NULL), 0);
        cr_expect(memcmp(got, pay[i], 2 * BLK) == 0, "put %d landed wrong", i);
        kvt_client_release(c, m.lease, NULL);
        free(pay[i]);
    }
    free(got);
    kvt_batch_destroy(b);
    kvt_client_close(c);
    kvd_cleanup(&d);
}

Test(client_batch, daemon_gone)
{
    kvd_t d = {0};
    kvd_start(&d, NULL);
    kvt_client_t *c = kvd_client(&d, "m", PAGE, 0);
    cr_assert_eq(kvt_client_ping(c, NULL), 0);
    cr_assert_eq(kvd_stop(&d), 0);
    int rc = kvt_client_ping(c, NULL);
    cr_expect(rc == KVT_CLIENT_ECLOSED || rc == -ECONNRESET || rc == -EPIPE, "ping: %s",
              kvt_client_strerror(rc));
    cr_expect_eq(kvt_client_ping(c, NULL), KVT_CLIENT_ECLOSED);
    kvt_client_close(c);
    kvt_client_conf_t conf = {.unix_path = d.sock, .model = "m", .page_size = PAGE};
    cr_expect_lt(kvt_client_connect(&c, &conf), 0, "no daemon: connect fails");
    conf.model = NULL;
    cr_expect_eq(kvt_client_connect(&c, &conf), KVT_CLIENT_EINVAL);
    kvd_cleanup(&d);
}

/* A fake daemon on a Unix socket for one connection: answers HELLO (saying max-frame 1 MiB, or
 * with a reply header claiming body bytes of `hello_body` when that is non-zero), then answers
 * the next request with a header claiming `body` bytes and sends nothing more. */
static pid_t fake_daemon(const char *path, uint32_t hello_body, uint32_t body)
{
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sun = {.sun_family = AF_UNIX};
    snprintf(sun.sun_path, sizeof sun.sun_path, "%s", path);
    unlink(path);
    cr_assert_eq(bind(lfd, (struct sockaddr *)&sun, sizeof sun), 0);
    cr_assert_eq(listen(lfd, 1), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid > 0) {
        close(lfd);
        return pid;
    }
    int fd = accept(lfd, NULL, NULL);
    uint8_t in[4096], out[KVT_PROTO_HDR + sizeof(kvt_wire_hello_reply_t)];
    for (int step = 0; step < 2 && fd >= 0; step++) {
        kvt_proto_hdr_t h;
        if (read(fd, in, KVT_PROTO_HDR) != KVT_PROTO_HDR)
            break;
        kvt_proto_hdr_decode(in, &h);
        if (h.body_len && read(fd, in, h.body_len) != (ssize_t)h.body_len)
            break;
        if (step == 0 && !hello_body) {
            kvt_wire_hello_reply_t r = {.max_frame = htole32(1u << 20)};
            kvt_proto_frame(out, h.opcode | KVT_OP_REPLY, 0, h.request_id, 0, sizeof r);
            memcpy(out + KVT_PROTO_HDR, &r, sizeof r);
            if (write(fd, out, sizeof out) != (ssize_t)sizeof out)
                break;
        } else {
            kvt_proto_frame(out, h.opcode | KVT_OP_REPLY, 0, h.request_id, 0,
                            step == 0 ? hello_body : body);
            if (write(fd, out, KVT_PROTO_HDR) != KVT_PROTO_HDR)
                break;
            break;
        }
    }
    sleep(5); /* keep the connection open: the client must not wait for the body */
    _exit(0);
}

/* A server whose reply header claims more than any reply of a real daemon can hold (its
 * max-frame, or 64 KiB before HELLO has told it) gets EPROTO at once: the client neither waits
 * for nor allocates a body it would never use. */
Test(client_batch, a_reply_longer_than_the_daemon_can_send_is_refused)
{
    char dir[] = "/tmp/kvt-fake.XXXXXX", path[64];
    cr_assert(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/k.sock", dir);
    kvt_client_conf_t conf = {
        .unix_path = path, .model = "m", .page_size = PAGE, .timeout_ms = 3000};
    kvt_client_t *c = NULL;

    pid_t pid = fake_daemon(path, 0, 1u << 30);
    cr_assert_eq(kvt_client_connect(&c, &conf), 0);
    uint64_t t0 = kvt_now_ns();
    cr_expect_eq(kvt_client_ping(c, NULL), KVT_CLIENT_EPROTO);
    cr_expect_lt(kvt_now_ns() - t0, 1000000000ull, "refused at the header, not at the timeout");
    kvt_client_close(c);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);

    pid = fake_daemon(path, 100u << 20, 0);
    c = NULL;
    cr_expect_eq(kvt_client_connect(&c, &conf), KVT_CLIENT_EPROTO, "a HELLO reply of 100 MiB");
    cr_expect_null(c);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    unlink(path);
    rmdir(dir);
}
