/*
 * conf.h: kvtierd's settings. One table (conf.c) names every setting once, with its type,
 * default and description; the configuration file ("name = value" lines) and the command line
 * ("--name=value" or "--name value") both set entries of that table, flags last, so that a flag
 * overrides the file and the file overrides the embedded default. docs/server.md documents the
 * same table. Internal to server/ (kvt__ names).
 */
#ifndef KVT_SERVER_CONF_H
#define KVT_SERVER_CONF_H

#include <stdint.h>
#include <stdio.h>

#include "common.h"
#include "tier.h"

/* index-prefault's value until kvt__conf_finish: the word "index-bytes" (its default), all of
 * index-bytes, whatever was set first. */
#define KVT_PREFAULT_INDEX_BYTES UINT64_MAX

typedef struct kvt_srv_conf {
    char *unix_path;    /* "" disables the Unix socket */
    uint32_t unix_mode; /* octal permission bits of the socket */
    char *tcp;          /* host:port; "" disables TCP */
    char *metrics;      /* host:port of the HTTP endpoint; "" disables it */
    char *data_dir;     /* NVMe tier directory */
    uint64_t dram_bytes;
    uint64_t nvme_bytes;
    uint64_t hbm_bytes;
    char *hbm_backend; /* "auto" (a GPU if usable, else none), "cuda", "host" */
    int hbm_device;
    char *hbm_devices; /* "0,1,...": an HBM pool per device (hbm-bytes each); "": hbm-device */
    int hbm_devs[KVT_HBM_MAX_DEVICES]; /* hbm-devices parsed (or hbm-device alone) */
    uint32_t hbm_ndevs;
    uint32_t hbm_batch; /* copies per batch, at most */
    uint64_t nvme_segment_bytes;
    int nvme_sparse;
    char *remote;       /* host:port of a Valkey/Redis server; "" for none */
    int remote_cluster; /* remote is a Cluster: seeds "host:port[,host:port...]" */
    uint64_t remote_bytes;
    char *remote_prefix;
    char *remote_password;
    int remote_db;
    uint32_t remote_ttl_s;
    uint32_t remote_timeout_ms;
    int nvme_recover; /* warm restart: rebuild the index from the NVMe tier */
    uint64_t max_frame;
    uint64_t index_bytes;    /* memory the prefix index may allocate; 0: no limit */
    uint64_t index_prefault; /* of it, mapped and faulted in at start (radix arena_reserve) */
    uint32_t max_conns;
    uint32_t lease_ms;         /* default lease time limit */
    uint32_t lease_ms_max;     /* the longest a client may ask for */
    int zero_copy;             /* MAP, LOCATE, RESERVE for clients on the Unix socket */
    uint32_t zero_copy_arenas; /* namespaces with a DRAM arena of their own at once */
    int hbm_ipc;               /* MAP of HBM: every local client is one tenant */
    uint32_t reserve_ms;       /* a reservation not committed this long is given back */
    uint32_t max_reservations; /* reservations one connection may hold at once */
    uint64_t max_resv_bytes;   /* room one connection's reservations hold (max-reserved-bytes) */
    int zc_checksum;           /* COMMIT seals its pages, checked as they leave DRAM */
    /* Bytes one namespace (tenant) may hold per tier, by kvt_tier_id_t ([NONE] unused); 0: no
     * quota (tenant-hbm-bytes, tenant-dram-bytes, tenant-nvme-bytes, tenant-remote-bytes). */
    uint64_t tenant_bytes[KVT_TIER_COUNT];
    uint32_t max_inflight;     /* tier I/Os in flight per connection before reads pause */
    uint32_t max_leases;       /* leases one connection may hold at once */
    uint32_t max_namespaces;   /* namespaces open at once */
    uint64_t max_output;       /* queued reply bytes per connection before reads pause */
    uint64_t max_client_bytes; /* clients' buffers beyond their base input buffers, all together */
    uint64_t sock_send_budget; /* Unix sockets' send buffers, all together (0: the kernel's) */
    uint32_t socket_turns;     /* per loop, connections with big replies in the kernel at once */
    /* A turn's holder whose socket took nothing this long, while others wait, passes it on. */
    uint32_t socket_turn_stall_ms;
    uint32_t reply_timeout_ms;   /* a socket that takes none of its replies this long is closed */
    uint32_t hello_timeout_ms;   /* a connection with no whole first frame this long is closed */
    uint32_t frame_timeout_ms;   /* a frame begun must be whole within it, or keep arriving at */
    uint64_t frame_min_rate;     /* ... this many bytes per second */
    uint32_t evict_idle_ms;      /* at max-conns, a connection idle this long may make room */
    uint32_t tick_ms;            /* housekeeping interval (leases, deadlines, gauges, clock) */
    uint32_t loops;              /* event loops; 0: one per CPU, at most 8 (loops.c) */
    uint32_t drain_ms;           /* SIGUSR1: the longest a drain waits before shutting down */
    double prefill_tokens_per_s; /* for the prefill-seconds-saved estimate */
    uint32_t metrics_namespaces; /* (model, adapter) pairs with series of their own */
    int mrc;                     /* the miss-ratio curve of the lookups (mrc.c) */
    double mrc_sample_rate;      /* its first sampling rate, (0, 1] */
    uint32_t mrc_max_keys;       /* pages it tracks at most */
    /* Tier policy (policy/policy.h): checked by kvt__conf_finish; see docs/server.md for what
     * the daemon does with them today. */
    char *policy;           /* cost, lru, lfu */
    char *policy_model;     /* a built-in model profile name */
    char *policy_hw;        /* a built-in hardware profile name */
    double policy_high;     /* high watermark, fraction of a tier's capacity */
    double policy_low;      /* low watermark */
    uint32_t nvme_min_hits; /* hits a block needs before it is demoted into NVMe */
    /* Of dram_bytes: old DRAM copies kept for promotions under a lease (exec.c). */
    double promote_keep_share;
    char *log_level;
    uint32_t log_rate; /* lines a second each rate-limited log line may write */
    char *secret;
    char *secret_file;
    uint32_t auth_failures_per_s; /* wrong AUTHs answered a second, all connections; 0: no limit */
    uint32_t auth_wait_ms;        /* the longest an AUTH answer waits for that rate */
    char *config;                 /* the file that was read, if any */
    int argc;                     /* the command line kvt__conf_args read (main's, borrowed), */
    char **argv;                  /* read again by kvt__conf_reload */
} kvt_srv_conf_t;

/* Fills conf with the embedded defaults (strings are malloc'ed). Returns 0 or KVT_ENOMEM. */
int kvt__conf_defaults(kvt_srv_conf_t *conf);
/* Frees the strings. */
void kvt__conf_free(kvt_srv_conf_t *conf);
/* Sets one setting by name (dashes and underscores alike) from its text form. Returns 0,
 * KVT_ENOENT for an unknown name, or KVT_EINVAL for a value out of range; err gets a message. */
int kvt__conf_set(kvt_srv_conf_t *conf, const char *name, const char *value, char *err,
                  size_t errlen);
/* Reads a configuration file. Returns 0 or an error with err saying file, line and why. */
int kvt__conf_load(kvt_srv_conf_t *conf, const char *path, char *err, size_t errlen);
/*
 * Applies argv: --config FILE first (wherever it is), then every other --name[=value]. Returns 0,
 * 1 when --help or --version printed something and the program should exit 0, or an error.
 */
int kvt__conf_args(kvt_srv_conf_t *conf, int argc, char **argv, char *err, size_t errlen);
/* Writes the table (name, default, description) for --help. */
void kvt__conf_usage(FILE *f);
/* Final checks after everything is applied (secret file read, ranges). */
int kvt__conf_finish(kvt_srv_conf_t *conf, char *err, size_t errlen);

/* Sets the process's log level and rate from conf (after kvt__conf_finish checked them). */
void kvt__conf_apply_log(const kvt_srv_conf_t *conf);

/* 1 when the setting `name` can change while the daemon runs (kvt__conf_reload applies it). */
int kvt__conf_reloadable(const char *name);

/*
 * SIGHUP: reads the settings again as at start (embedded defaults, the --config file, then the
 * flags of cur->argv) and checks them. When they are valid, every reloadable setting that
 * changed is copied into cur (logged at info) and each other one that changed is logged as
 * needing a restart (cur keeps it); the log settings are applied. Returns the number of
 * settings changed, or a negative code with err filled (a missing file, a bad value) and cur
 * unchanged. The caller hands the policy's knobs on (kvt_policy_tune).
 */
int kvt__conf_reload(kvt_srv_conf_t *cur, char *err, size_t errlen);

#endif
