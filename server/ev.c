/*
 * ev.c: the epoll sets' registrations. Every descriptor a loop watches (sockets, the signalfd,
 * the tiers' completion fds, the metrics port, a loop's eventfd) is added, changed and removed
 * here; loop.c and loops.c wait. kvt__ev_add and its kin act on loop 0's set; a connection's
 * registrations go to its own loop's set through kvt__ev_ctl (epoll_ctl is safe on another
 * thread's set).
 */
#include "server.h"

#include <errno.h>
#include <sys/epoll.h>

int kvt__ev_ctl(int epfd, int op, kvt__ev_t *ev, uint32_t events)
{
    struct epoll_event e = {.events = events, .data.ptr = ev};
    return epoll_ctl(epfd, op, ev->fd, op == EPOLL_CTL_DEL ? NULL : &e) < 0 ? -errno : 0;
}

int kvt__ev_add(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    return kvt__ev_ctl(s->epfd, EPOLL_CTL_ADD, ev, events);
}

int kvt__ev_mod(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    return kvt__ev_ctl(s->epfd, EPOLL_CTL_MOD, ev, events);
}

void kvt__ev_del(kvt_srv_t *s, kvt__ev_t *ev)
{
    kvt__ev_ctl(s->epfd, EPOLL_CTL_DEL, ev, 0);
}
