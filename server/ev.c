/*
 * ev.c: the epoll set's registrations. Every descriptor the loop watches (sockets, the signalfd,
 * the tiers' completion fds, the metrics port) is added, changed and removed here; loop.c waits.
 */
#include "server.h"

#include <errno.h>
#include <sys/epoll.h>

int kvt__ev_add(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    struct epoll_event e = {.events = events, .data.ptr = ev};
    return epoll_ctl(s->epfd, EPOLL_CTL_ADD, ev->fd, &e) < 0 ? -errno : 0;
}

int kvt__ev_mod(kvt_srv_t *s, kvt__ev_t *ev, uint32_t events)
{
    struct epoll_event e = {.events = events, .data.ptr = ev};
    return epoll_ctl(s->epfd, EPOLL_CTL_MOD, ev->fd, &e) < 0 ? -errno : 0;
}

void kvt__ev_del(kvt_srv_t *s, kvt__ev_t *ev)
{
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, ev->fd, NULL);
}
