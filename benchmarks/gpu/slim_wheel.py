"""Rewrites a wheel without the files a machine will not load, keeping its RECORD true.

    python benchmarks/gpu/slim_wheel.py WHEEL 'bitsandbytes/libbitsandbytes_*.so' --keep '*cuda13*' --keep '*cpu*'

Files matching the drop pattern are left out unless they also match a --keep pattern.
bitsandbytes ships one library per CUDA version (43 MB in all); the device machine's torch
loads one of them, so the kit carries those alone and stays far under the 64 MiB a call
may send.
"""

from __future__ import annotations

import argparse
import fnmatch
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: str, keep: list[str]) -> list[str]:
    """Rewrites `wheel` in place; returns the names left out."""
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as target:
        dropped = [name for name in source.namelist()
                   if fnmatch.fnmatch(name, drop) and not any(fnmatch.fnmatch(name, k) for k in keep)]
        for info in source.infolist():
            name = info.filename
            if name in dropped:
                continue
            data = source.read(info)
            if name.endswith(".dist-info/RECORD"):
                # pip reads RECORD to know what it installed: a listed file that is absent breaks uninstall.
                lines = data.decode().splitlines()
                data = ("\n".join(l for l in lines if l.split(",", 1)[0] not in dropped) + "\n").encode()
            target.writestr(info, data)
    slimmed.replace(wheel)
    return dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("drop", help="files to leave out (a glob over names in the wheel)")
    parser.add_argument("--keep", action="append", default=[], help="files kept although they match the drop glob")
    args = parser.parse_args()
    dropped = slim(args.wheel, args.drop, args.keep)
    print(f"{args.wheel.name}: left out {len(dropped)} files, {args.wheel.stat().st_size / 2**20:.1f} MiB now")


if __name__ == "__main__":
    main()
