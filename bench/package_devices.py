"""Which device a compiled package's code names: ``python -m bench.package_devices FOLDER``.

Reads every package (``forward-*.bin``, a zip archive) under FOLDER and counts, in its
generated code, the places that fix a CUDA device by index (``_DeviceGuard(N)``,
``set_device(N)``, ``get_raw_stream(N)``, ``'cuda:N'``): the evidence for why a
package compiled on one card cannot run on another in the same process numbering.
"""

from __future__ import annotations

import re
import sys
import zipfile
from collections import Counter
from pathlib import Path

_PATTERNS = re.compile(
    rb"_DeviceGuard\(\d+\)|set_device\(\d+\)|get_raw_stream\(\d+\)"
    rb"|device\(type='cuda', index=\d+\)|'cuda:\d+'"
)


def main(argv: list[str]) -> int:
    for package in sorted(Path(argv[0]).rglob("forward-*.bin")):
        found: Counter[str] = Counter()
        if zipfile.is_zipfile(package):
            with zipfile.ZipFile(package) as archive:
                texts = [archive.read(member) for member in archive.namelist()]
        else:
            texts = [package.read_bytes()]
        for text in texts:
            for match in _PATTERNS.finditer(text):
                found[match.group(0).decode()] += 1
        print(f"{package.name}: {dict(found) or 'no device index in its code'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
