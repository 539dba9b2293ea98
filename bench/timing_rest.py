"""Where a restore's engine time goes beyond its copy, from committed e2e_ttft logs (no GPU):
for every restore row of every ``xkv*.log`` in the given ``e2e_*.tar.xz`` files, the engine's
scheduled-to-first-token time, the ``XKV_TIMING`` line just before it (copy GPU ms, host issue
ms) and the rest = engine - copy - issue. bench/RESULTS.md "stop 33" tabulates the output.

    python bench/timing_rest.py --json OUT.json bench/results/h200_2026-12-03_stop3*/call*_e2e_*.tar.xz
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile

TIMING = re.compile(r"XKV_TIMING restore bytes=(\d+) copy_ms=([\d.]+) issue_ms=([\d.]+)")


def field(line: str, name: str) -> float | None:
    """The number of ``name=`` on an ``XKV_TIMING`` line (``pre_ms``, ``sync_ms``, ...; the
    optional ones are absent on some lines and on older engines' lines): None where absent."""
    m = re.search(rf" {re.escape(name)}=([\d.]+)", line)
    return float(m[1]) if m else None


def rows_of(text: str) -> list[dict]:
    """Restore rows of one engine log with the timing line that preceded each."""
    out, last = [], None
    mode = re.search(r"XKV: stores: save_mode '(\w+)'", text)
    for line in text.splitlines():
        m = TIMING.search(line)
        if m:
            last = (int(m[1]), float(m[2]), float(m[3]))
        elif line.startswith("E2E_ROW "):
            r = json.loads(line[8:])
            if r["phase"] == "restore" and last is not None:
                nbytes, copy, issue = last
                out.append(dict(kind=r["kind"], tokens=r["tokens"], engine_ms=r["engine_ms"],
                                copy_ms=copy, issue_ms=issue, bytes=nbytes,
                                rest_ms=round(r["engine_ms"] - copy - issue, 2),
                                save_mode=mode[1] if mode else None))
            last = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tars", nargs="+")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    res = []
    for path in a.tars:
        with tarfile.open(path) as tf:
            for m in tf.getmembers():
                name = m.name.rsplit("/", 1)[-1]
                if name.startswith("xkv") and name.endswith(".log"):
                    text = tf.extractfile(m).read().decode(errors="replace")
                    res += [dict(source=path, log=m.name, **r) for r in rows_of(text)]
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    for r in res:
        print(f"{r['source'].split('/')[-2]} {r['kind']:<40} {r['save_mode'] or '-':<5} "
              f"{r['tokens']:>6} engine {r['engine_ms']:6.1f} copy {r['copy_ms']:5.1f} "
              f"issue {r['issue_ms']:5.1f} rest {r['rest_ms']:5.1f}")


if __name__ == "__main__":
    main()
