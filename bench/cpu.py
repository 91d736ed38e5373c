"""CPU accounting for the cost benchmarks: this process, and every process it started (a builder helper).

A round of paced transfers costs the helper a few tens of milliseconds, and /proc/<pid>/stat counts in clock
ticks (10 ms), so a helper's CPU is read per thread from /proc/<pid>/task/<tid>/schedstat (nanoseconds on the CPU).
A thread that ends takes its schedstat with it: when one of a process's threads is gone at the end of a round,
that process's round falls back to the tick count of /proc/<pid>/stat (which keeps ended threads), and says so.
This process's own CPU is time.process_time_ns(): every thread, ended ones included, in nanoseconds.
"""

import os
import time
from typing import Dict, Iterable, Optional

TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list:
    """The fields after the command name of a /proc .../stat file (the name may hold spaces and ')')."""
    with open(path, encoding="ascii", errors="replace") as handle:
        text = handle.read()
    return text[text.rindex(")") + 2:].split()


def ticks_ns(pid: int) -> float:
    """utime + stime of a whole process, ended threads included (clock-tick resolution)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) * TICK_NS


def threads_ns(pid: int) -> Dict[int, int]:
    """tid -> nanoseconds on the CPU, for the threads alive now."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as handle:
                found[int(tid)] = int(handle.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return found


def descendants(root: int, exclude: Iterable[int] = ()) -> list:
    """Every live process below `root` (children, their children, ...), minus `exclude` and what is below them."""
    children: Dict[int, list] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            parent = int(_stat_fields(f"/proc/{name}/stat")[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(name))
    skip, found, todo = set(exclude), [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in skip:
                found.append(child)
                todo.append(child)
    return found


class Snapshot:
    """CPU so far: this process (ns), and each descendant's (or each given process's) threads and tick count."""

    def __init__(self, exclude: Iterable[int] = (), pids: Optional[Iterable[int]] = None):
        """`pids`: these processes instead of this one's descendants."""
        self.own_ns = time.process_time_ns()
        self.others = {}  # pid -> (threads {tid: ns}, ticks ns)
        for pid in descendants(os.getpid(), exclude) if pids is None else pids:
            try:
                self.others[pid] = (threads_ns(pid), ticks_ns(pid))
            except (OSError, ValueError, IndexError):
                pass


def used(before: Snapshot, after: Snapshot) -> dict:
    """What was used between two snapshots: own_ns, others_ns (processes started in between counted whole),
    and how many processes had to be counted in clock ticks (a thread of theirs ended) or were lost (the process
    ended in between: its CPU is not counted)."""
    others, coarse, lost = 0.0, 0, 0
    for pid, (threads, ticks) in after.others.items():
        earlier: Optional[tuple] = before.others.get(pid)
        if earlier is None:
            others += sum(threads.values())
        elif set(earlier[0]) <= set(threads):
            others += sum(threads[t] - earlier[0][t] for t in earlier[0]) + sum(
                ns for t, ns in threads.items() if t not in earlier[0])
        else:
            others += ticks - earlier[1]
            coarse += 1
    lost = sum(1 for pid in before.others if pid not in after.others)
    return {"own_ns": after.own_ns - before.own_ns, "others_ns": others, "coarse": coarse, "lost": lost,
            "processes": len(after.others)}
