"""Run the ``conveyor`` command under cProfile, in every worker thread, and save the stats.

``python -m bench.profiled STATS_FILE worker --model ...`` behaves like
``conveyor worker --model ...`` and, when the worker exits (SIGTERM drains it),
writes one merged ``pstats`` file. The worker's own threads are profiled, not
only the main one: it decodes requests in a thread pool and builds results on
its model thread, and those costs are per request too.

Profiling starts when the first ``conveyor-*`` thread (a decode or model
thread, started lazily with the first records) starts, so imports, model
loading and warm-up stay out of the stats: what remains is steady serving.

Times are wall-clock, as cProfile's are by default: a thread that releases the
GIL (in a socket call, say) is charged until it gets the GIL back. (Per-thread
CPU time would not charge that wait, but its clock costs a system call per
event, which swamps the small functions it is meant to measure.)
"""

from __future__ import annotations

import cProfile
import pstats
import signal
import sys
import threading
from types import FrameType
from typing import Any

from producers.cli import main as conveyor_main

_WORKER_THREADS = "conveyor-"  # name prefix of the pipeline's decode and model threads
_START_SIGNAL = signal.SIGUSR1

_main_profile = cProfile.Profile()
_profiles: list[cProfile.Profile] = [_main_profile]
_lock = threading.Lock()
_started = threading.Event()


def _profile_new_thread(frame: FrameType | None, event: str, arg: Any) -> None:
    """Installed by ``threading.setprofile``: the first profiling event of each new
    thread lands here. A worker thread gets a profiler of its own; the first one
    also starts the main thread's profiler, through a signal, since a profiler can
    only be switched on from the thread it profiles."""
    if not threading.current_thread().name.startswith(_WORKER_THREADS):
        sys.setprofile(None)
        return
    profile = cProfile.Profile()
    with _lock:
        _profiles.append(profile)
    profile.enable()  # replaces this hook for the current thread
    if not _started.is_set():
        _started.set()
        main_id = threading.main_thread().ident
        assert main_id is not None
        signal.pthread_kill(main_id, _START_SIGNAL)


def _start_main_profile(signum: int, frame: FrameType | None) -> None:
    _main_profile.enable()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m bench.profiled STATS_FILE worker [worker options]", file=sys.stderr)
        return 2
    stats_path, conveyor_argv = argv[0], argv[1:]
    signal.signal(_START_SIGNAL, _start_main_profile)
    threading.setprofile(_profile_new_thread)
    try:
        status = conveyor_main(conveyor_argv)
    finally:
        _main_profile.disable()
        threading.setprofile(None)  # None removes the hook
        if _started.is_set():
            with _lock:
                # Pool threads are idle by now (the worker drained), so their
                # profilers can be read from this thread.
                stats = pstats.Stats(*_profiles)
            stats.dump_stats(stats_path)
        else:
            print(
                "bench.profiled: no worker thread ever started; nothing profiled", file=sys.stderr
            )
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
