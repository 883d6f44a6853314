/*
 * replay.h: replays Mooncake JSONL traces through the real radix index and the real policy
 * engine in simulated time, and prints one JSON object per policy per trace. The kvtier CLI
 * dispatches "kvtier replay ..." here; kvtier-replay is the same thing stand-alone.
 */
#ifndef KVT_REPLAY_H
#define KVT_REPLAY_H

/* argv[0] is the program name; the rest are options and trace files ("--help" lists them).
 * Writes results to stdout, progress and errors to stderr. Returns 0, 1 on a failed run, or 2
 * on a usage error. */
int kvt_replay_main(int argc, char **argv);

#endif
