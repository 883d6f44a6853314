#!/bin/bash
# stop_cont.sh CMD [ARG]...: runs CMD, stopping it (SIGSTOP) and letting it go on (SIGCONT) every
# few tenths of a second until it ends, and exits with its status. After such a stop Linux makes
# some blocking calls fail with EINTR even where no handler is set (epoll_wait among them,
# signal(7)); a debugger or a machine's job control may stop a benchmark so, and its load
# generator must go on through it (the test bench_server_stopped).
"$@" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
    sleep 0.3
    kill -STOP "$pid" 2>/dev/null || break
    sleep 0.05
    kill -CONT "$pid" 2>/dev/null
done
wait "$pid"
