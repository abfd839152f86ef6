"""`python -m kvbench.p2p.transports.mooncake fetch-libs|status`: make or show the private
copy of the Debian libraries Mooncake's binaries need (kvbench.p2p.transports.mooncake.libs)."""

from __future__ import annotations

import sys

from kvbench.p2p.transports.mooncake import libs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["fetch-libs"], ["status"]):
        print("usage: python -m kvbench.p2p.transports.mooncake fetch-libs|status", file=sys.stderr)
        return 2
    if argv == ["fetch-libs"]:
        gone = libs.missing()
        if not gone:
            print("Mooncake's libraries are all there (system or private copy); nothing fetched")
            return 0
        try:
            root = libs.fetch()
        except (RuntimeError, OSError, TimeoutError) as exc:
            print(f"kvbench: {exc}", file=sys.stderr)
            return 1
        print(f"private copy of {', '.join(gone)} in {root} (loaded only by Mooncake's processes)")
    for soname in libs.SONAMES:
        where = ("system" if libs.on_system(soname) else
                 str(libs.private_copy().get(soname, "missing")))
        print(f"{soname}: {where}")
    gone = libs.missing()
    return 0 if not gone else 1


if __name__ == "__main__":
    sys.exit(main())
