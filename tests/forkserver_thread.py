"""Imported by a fork server in a test: it starts a thread, which makes forking unsafe."""

from __future__ import annotations

import threading
import time

threading.Thread(target=time.sleep, args=(60,), name="left-running", daemon=True).start()
