"""Imported by a fork server in a test: it starts a thread that ``threading`` does not
know of, as a library's native thread pool would."""

from __future__ import annotations

import _thread
import time

_thread.start_new_thread(time.sleep, (60,))
