"""How torch's OpenMP threads wait between parallel regions, chosen once before torch loads OpenMP (libgomp reads
the environment when it loads). Imported first by engine.py, so the command lines and the Python API get the same
default; a process that imported torch before it keeps whatever libgomp read then.

The rule: OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user are kept. Otherwise the threads spin (ACTIVE) when the
machine's other processes leave the cores idle at start-up, and wait passively (PASSIVE) when they keep at least
half a core busy: spinning threads fight a busy process for the cores and a run collapses, while on an idle machine
passive waiting costs a compiled decode step about half its speed (docs/performance.md, "Threads")."""
import os
import time

BUSY_CORES = 0.5  # other processes' load, in cores, from which the threads wait passively


def busy_cores(interval: float = 0.1) -> float | None:
    """Cores kept busy by every process over `interval` seconds (from /proc/stat's jiffies); None where it cannot be
    read. This process is importing Python modules meanwhile: it counts for at most one core's share."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle
    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / (total1 - total0))


def choose_wait_policy() -> str:
    """Set OMP_WAIT_POLICY for this process (the rule in the module's docstring) and return what it now is."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return os.environ.get("OMP_WAIT_POLICY", f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    busy = busy_cores()
    policy = "ACTIVE" if busy is not None and busy < BUSY_CORES else "PASSIVE"
    os.environ["OMP_WAIT_POLICY"] = policy
    return policy


WAIT_POLICY = choose_wait_policy()
