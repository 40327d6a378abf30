"""fork() from Python while other threads allocate through tidepool: os.fork
(children leaving with sys.exit and with os._exit) and a multiprocessing
pool with the fork start method (what a DataLoader with workers does),
with threads' caches on and off (the suite runs with expandable segments
on and off). Each run is a fresh interpreter: the library reads its
configuration once. A child that hangs is killed by an alarm and fails
the test.

Run over the installed package (tools/tests/tools/python.rs) with
TIDEPOOL_CONF selecting the host backend.
"""
import os
import subprocess
import sys
import textwrap
import unittest

# The parent: threads allocating, freeing and reading statistics through
# ctypes (which lets go of the GIL: they run while the main thread forks).
PARENT = textwrap.dedent(
    """
    import os, signal, sys, threading, warnings
    import tidepool
    from tidepool import _native
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
    lib = _native.lib()
    stop = threading.Event()
    failures = []

    def work(stream):
        sizes = [512, 4096, 3 << 20]
        while not stop.is_set():
            ptrs = [(lib.tidepool_malloc(s, 0, stream), s) for s in sizes]
            if not all(p for p, _ in ptrs):
                failures.append("malloc failed")
            for p, s in ptrs:
                lib.tidepool_free(p, s, 0, stream)
            tidepool.memory_stats()

    def child_checks():
        # The child's allocator is its own: exactly what it allocated.
        p = lib.tidepool_malloc(4096, 0, None)
        q = lib.tidepool_malloc(3 << 20, 0, None)
        stats = tidepool.memory_stats()
        assert p and q and stats["allocated_bytes.all.current"] == 4096 + (3 << 20), stats["allocated_bytes.all.current"]
        lib.tidepool_free(p, 4096, 0, None)
        lib.tidepool_free(q, 3 << 20, 0, None)
        assert tidepool.memory_allocated() == 0
        tidepool.empty_cache()
        assert tidepool.memory_reserved() == 0, tidepool.memory_reserved()
        return tidepool.memory_stats()["allocation.all.allocated"]

    mine = lib.tidepool_malloc(4096, 0, None)  # the main thread uses tidepool too
    lib.tidepool_free(mine, 4096, 0, None)
    threads = [threading.Thread(target=work, args=(stream,)) for stream in (None, 7, 9)]
    for t in threads:
        t.start()
    """
)

OS_FORK = PARENT + textwrap.dedent(
    """
    for i in range(FORKS):
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            try:
                code = 0 if child_checks() == 2 else 3
            except BaseException:
                code = 2
            if i % 2 == 0:
                sys.exit(code)  # the interpreter's exit: atexit, thread-local destructors
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            failures.append(f"child {i} killed by signal {os.WTERMSIG(status)} (SIGALRM {int(signal.SIGALRM)}: it hung)")
            break
        if os.WEXITSTATUS(status) != 0:
            failures.append(f"child {i} failed its checks ({os.WEXITSTATUS(status)})")
    stop.set()
    for t in threads:
        t.join()
    assert tidepool.memory_allocated() == 0, tidepool.memory_allocated()
    print("forks:", FORKS, "failures:", failures)
    sys.exit(1 if failures else 0)
    """
)

POOL = PARENT + textwrap.dedent(
    """
    import multiprocessing

    def task(i):
        signal.alarm(20)
        count = child_checks()
        signal.alarm(0)
        return count

    with multiprocessing.get_context("fork").Pool(4) as pool:
        counts = pool.map_async(task, range(TASKS)).get(timeout=120)
    stop.set()
    for t in threads:
        t.join()
    # Each worker's allocator is its own: its count grows by two a task.
    assert sorted(set(c % 2 for c in counts)) == [0] and len(counts) == TASKS, counts
    assert tidepool.memory_allocated() == 0, tidepool.memory_allocated()
    print("tasks:", TASKS, "failures:", failures)
    sys.exit(1 if failures else 0)
    """
)


class Fork(unittest.TestCase):
    def run_script(self, script, extra_conf):
        conf = ",".join(c for c in [os.environ.get("TIDEPOOL_CONF", ""), extra_conf] if c)
        result = subprocess.run(
            [sys.executable, "-c", script],
            env=dict(os.environ, TIDEPOOL_CONF=conf),
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(result.returncode, 0, f"{conf}:\n{result.stdout}{result.stderr}")
        self.assertIn("failures: []", result.stdout)

    def test_os_fork_while_threads_allocate(self):
        for caches in ("", "thread_cache_blocks:0"):
            with self.subTest(caches=caches or "thread caches on"):
                self.run_script(OS_FORK.replace("FORKS", "200"), caches)

    def test_a_multiprocessing_pool_with_fork_while_threads_allocate(self):
        for caches in ("", "thread_cache_blocks:0"):
            with self.subTest(caches=caches or "thread caches on"):
                self.run_script(POOL.replace("TASKS", "100"), caches)


if __name__ == "__main__":
    unittest.main()
