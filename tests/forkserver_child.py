"""A process the fork server's tests start (``python -m tests.forkserver_child MODE``): it
says what it was given, then exits with status MODE or, given ``wait``, waits for a
signal."""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":
    mode = sys.argv[1]
    print(f"args={sys.argv[1:]} value={os.environ.get('FORKSERVER_TEST_VALUE')}", flush=True)
    print(f"session={os.getsid(0) == os.getpid()} preloaded={'colorsys' in sys.modules}")
    sys.stdout.flush()
    if mode == "wait":
        signal.pause()  # until SIGTERM's default action ends it
    sys.exit(int(mode))
