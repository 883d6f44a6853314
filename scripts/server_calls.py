#!/usr/bin/env python3
"""Which files of server/ call which: a file calls another when it names a kvt__ function
(or a kvt__ variable) that the other defines. Prints the graph and every call circle (strongly
connected group of files); exits 1 when there is one. A function reached through a pointer (a
hook: a reply source, the policy's ops, a tier's callback) is not a call: that is how a lower
file hands control back up without knowing the file above it.

It also keeps the door to the store (server/store.h, docs/architecture.md): only the door's files
(at most 5) may call a function that radix/radix.h or tiers/tier.h declares; exits 1 when another
file does, when the door grows past 5 files, when a door call (below) is defined outside the
door, or when docs/architecture.md does not name it or its table of the door's calls differs from
the code's. With --door it prints that table as docs/architecture.md should have it."""
import glob, os, re, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'server')
src = {}
for p in sorted(glob.glob(os.path.join(root, '*.c'))):
    t = open(p).read()
    t = re.sub(r'/\*.*?\*/', ' ', t, flags=re.S)          # comments
    t = re.sub(r'"(\\.|[^"\\])*"', '""', t)                # strings
    src[os.path.basename(p)] = t
defs = {}
for f, t in src.items():
    # a definition: a kvt__ name followed by ( at the start of a line's declarator and then {;
    # it starts in column 0 (an indented `if (kvt__f(x)) {` is a call, not a definition)
    for m in re.finditer(r'^(?!\s)[\w \*]*?\b(kvt__\w+)\s*\([^;{]*\)\s*\{', t, flags=re.M | re.S):
        defs.setdefault(m.group(1), f)
    for m in re.finditer(r'^(?:const )?[\w \*]+\b(kvt__\w+)\s*=', t, flags=re.M):
        defs.setdefault(m.group(1), f)
calls = {f: set() for f in src}
for f, t in src.items():
    for m in re.finditer(r'\b(kvt__\w+)\s*\(', t):
        g = defs.get(m.group(1))
        if g and g != f:
            calls[f].add(g)
    for m in re.finditer(r'&(kvt__\w+)\b', t):  # a variable taken by address (kvt__exec_ops)
        g = defs.get(m.group(1))
        if g and g != f:
            calls[f].add(g)
for f in sorted(calls):
    print('%-14s -> %s' % (f, ' '.join(sorted(calls[f])) or '-'))
# Tarjan's strongly connected components
index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in calls[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        c = []
        while True:
            w = stack.pop(); on.discard(w); c.append(w)
            if w == v: break
        if len(c) > 1: sccs.append(sorted(c))
sys.setrecursionlimit(10000)
for v in sorted(calls):
    if v not in index: visit(v)
for c in sccs:
    print('circle:', ' '.join(c))

# The door to the store: the files that may call radix/ and tiers/ themselves (store.h).
DOOR = {'store.c', 'exec.c', 'tierio.c', 'index.c', 'loop.c'}
# Files not yet moved behind the door: none. A file added here may call radix/ and tiers/ while it
# moves behind the door; the list only shrinks.
PENDING = set()
lower = set()
for h in ('radix/radix.h', 'tiers/tier.h'):
    ht = open(os.path.join(root, '..', h)).read()
    ht = re.sub(r'/\*.*?\*/', ' ', ht, flags=re.S)
    lower.update(re.findall(r'\b(kvt_\w+)\s*\(', ht))
bad = 0
if len(DOOR) > 5:
    print('door: %d files, at most 5' % len(DOOR)); bad = 1
for f, t in sorted(src.items()):
    used = sorted(set(m.group(1) for m in re.finditer(r'\b(kvt_\w+)\s*\(', t)) & lower)
    if not used:
        continue
    if f in DOOR:
        print('%-14s door: %d radix/tiers functions' % (f, len(used)))
    elif f in PENDING:
        print('%-14s not yet behind the door: %s' % (f, ' '.join(used)))
    else:
        print('%-14s calls radix/ or tiers/ outside the door (server/store.h): %s'
              % (f, ' '.join(used)))
        bad = 1

# The door's calls: what store.h declares (the tree and the tiers), and what the door's files
# other than loop.c (whose own calls are the daemon's lifecycle, for main.c) define for the others
# beside it in server.h (the executor's, the index budget's, a request's tier I/O). Each must be
# defined in a door file and named in docs/architecture.md, so that its list is the door.
sh = open(os.path.join(root, 'store.h')).read()
sh = re.sub(r'/\*.*?\*/', ' ', sh, flags=re.S)
door_calls = [(fn, 'store.h') for fn in dict.fromkeys(re.findall(r'\b(kvt__\w+)\s*\(', sh))]
declared = set(fn for fn, _ in door_calls)
for fn, home in sorted(defs.items(), key=lambda d: (d[1], d[0])):
    if home in DOOR - {'loop.c'} and fn not in declared and any(
            f not in DOOR and re.search(r'\b%s\s*\(' % fn, t) for f, t in src.items()):
        door_calls.append((fn, 'server.h'))
arch = open(os.path.join(root, '..', 'docs', 'architecture.md')).read()
rows = []
for fn, hdr in door_calls:
    home = defs.get(fn)
    users = sorted(f for f, t in src.items()
                   if f != home and f not in DOOR and re.search(r'\b%s\s*\(' % fn, t))
    rows.append((fn, hdr, home, users))
    if home not in DOOR:
        print('door: %s (%s) is defined in %s, not in a door file' % (fn, hdr, home)); bad = 1
    if not re.search(r'`%s[`(]' % fn, arch):
        print('door: %s (%s) is not named in docs/architecture.md' % (fn, hdr)); bad = 1
table = ['| call | declared in | defined in | called by (outside the door) |', '|---|---|---|---|']
table += ['| `%s` | %s | `%s` | %s |' % (fn, hdr, home, ', '.join('`%s`' % u for u in users) or '-')
          for fn, hdr, home, users in rows]
# The page's table is this one, row for row: a caller added or gone shows here first.
if '\n'.join(table) not in arch:
    print('door: the table of the door\'s calls in docs/architecture.md is not what the code says '
          '(scripts/server_calls.py --door prints it)'); bad = 1
if '--door' in sys.argv[1:]:
    print('\n'.join(table))
sys.exit(1 if sccs or bad else 0)
