/* main.c: kvtier-replay, the trace replay as a program of its own (see replay.h). */
#include "replay.h"

int main(int argc, char **argv)
{
    return kvt_replay_main(argc, argv);
}
