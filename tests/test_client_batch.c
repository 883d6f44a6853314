/*
 * test_client_batch.c: libkvtier's pipelined batches against the real daemon: a thousand requests
 * in one run (more than the socket buffers hold, so writing and reading must interleave), each
 * with its own status and result; an error in the middle touches only its own entry; a closed
 * daemon makes every later call fail with ECLOSED instead of hanging.
 */
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
