"""Turn the native backtrace that tritonserver prints on a crash into function names and source lines.

tritonserver's signal handler prints raw addresses (``N# 0x... in /path/lib.so``); with a memory map of the
process saved while it ran (``/proc/<pid>/maps``) and a library built with debug info
(``omni-triton build python-backend --debug``), addr2line gives the frames.

    python benchmarks/gpu_backend_check/symbolize.py tritonserver.log maps.txt
"""
import re
import subprocess
import sys
from pathlib import Path


def main(log_path: str, maps_path: str) -> None:
    bases = {}
    for line in Path(maps_path).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[4] != "0":
            start, offset, path = int(parts[0].split("-")[0], 16), int(parts[2], 16), parts[5]
            bases.setdefault(path, start - offset)
    for line in Path(log_path).read_text(errors="replace").splitlines():
        match = re.match(r"\s*(\d+)# 0x([0-9A-Fa-f]+) in (\S+)", line)
        if not match:
            continue
        frame, address, path = match.group(1), int(match.group(2), 16), match.group(3)
        resolved = Path(path).resolve()
        base = bases.get(str(resolved), bases.get(path))
        where = "?"
        if base is not None:
            where = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", str(resolved), hex(address - base)],
                                   capture_output=True, text=True).stdout.replace("\n", " | ")
        print(f"{frame:>3} {resolved.name}: {where}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
