"""The device check's closing report: versions, then one row per measured GPU migration.

    python scripts/device_report.py FIGURES.jsonl

FIGURES.jsonl is what the GPU suite appended (tests/gpu/devicetools.record): one JSON object per
migration (`ferry migrate --json` plus label, GPU and bit_identical), or a note ("label", "note").
A note with "fake", "driver" and "agrees" is a driver fact (devicetools.record_fact): what the
unit tests' fake driver assumes, what the real one answered, and whether they agree; the report
lists those under their own heading. Prints what is there; a missing file or row is said, never
invented.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path

#: Column → the phase names ferry reports (source phases, then the target's with "target ").
PHASES = {
    "lock": ("cuda lock",),
    "checkpoint": ("cuda checkpoint",),
    "criu dump": ("dump",),
    "transfer": ("pages", "transfer"),
    "criu restore": ("target restore",),
    "cuda restore": ("target cuda restore",),
    "unlock": ("target cuda unlock",),
}


def versions() -> list[str]:
    lines = [f"python: {platform.python_version()} ({sys.executable})"]
    for dist in ("cuda-bindings", "nvidia-ml-py", "torch"):
        try:
            lines.append(f"{dist}: {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{dist}: not installed")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            lines.append(f"nvidia driver: {_text(pynvml.nvmlSystemGetDriverVersion())}")
            lines.append(f"nvml: {_text(pynvml.nvmlSystemGetNVMLVersion())}")
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            lines.append(f"cuda (driver API): {cuda // 1000}.{cuda % 1000 // 10}")
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                lines.append(
                    f"gpu {i}: {_text(pynvml.nvmlDeviceGetName(h))} {_text(pynvml.nvmlDeviceGetUUID(h))}"
                )
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # the report says what it could not read
        lines.append(f"nvml: not readable ({e})")
    return lines


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _phase(phases: dict[str, float], names: tuple[str, ...]) -> float | None:
    got = [phases[n] for n in names if n in phases]
    return sum(got) if got else None


def _rate(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s" if seconds and nbytes else "-"


def _s(v: float | None) -> str:
    return f"{v:.3f}" if v is not None else "-"


def table(rows: list[dict]) -> list[str]:
    head = ["job", "GPU bytes", *PHASES, "D2H", "H2D", "frozen", "downtime", "bit-identical"]
    out = [head]
    for r in rows:
        ph = r.get("phases_s", {})
        gpu = int(r.get("gpu_bytes", 0))
        cells = [r["label"], f"{gpu / 2**30:.2f} GiB"]
        cells += [_s(_phase(ph, names)) for names in PHASES.values()]
        cells += [_rate(gpu, ph.get("cuda checkpoint")), _rate(gpu, ph.get("target cuda restore"))]
        down = r.get("downtime_s")
        cells += [_s(r.get("frozen_s")), _s(down) if down is not None else "not measured"]
        cells.append("yes" if r.get("bit_identical") else "NO")
        out.append(cells)
    widths = [max(len(str(row[i])) for row in out) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in out]


def is_fact(note: object) -> bool:
    return isinstance(note, dict) and {"fake", "driver", "agrees"} <= set(note)


def facts(notes: list[dict]) -> list[str]:
    """Each driver fact: its verdict, what the fake assumes, what the driver answered, the rest."""
    out = []
    for n in notes:
        fact = n["note"]
        out.append(f"{n['label']}: {'AGREES' if fact['agrees'] else 'DIFFERS'}")
        out.append(f"  the fake assumes: {fact['fake']}")
        out.append(f"  the driver answered: {fact['driver']}")
        rest = {k: v for k, v in fact.items() if k not in ("fake", "driver", "agrees")}
        if rest:
            out.append(f"  measured: {json.dumps(rest, sort_keys=True)}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("== versions")
    print("\n".join(versions()))
    path = Path(argv[0])
    rows, notes = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            (notes if "note" in rec else rows).append(rec)
    print("== measured (seconds unless marked; one row per migration)")
    if rows:
        print("\n".join(table(rows)))
        print("GPU placement: " + "; ".join(f"{r['label']}: {r.get('gpu', '?')}" for r in rows))
    else:
        print(f"no migration was measured ({path} {'is empty' if path.exists() else 'does not exist'})")
    print("== driver facts (the fake's assumptions)")
    found = [n for n in notes if is_fact(n["note"])]
    print("\n".join(facts(found)) if found else "no driver fact was recorded")
    others = [n for n in notes if not is_fact(n["note"])]
    if others:
        print("== other driver answers")
    for n in others:
        print(f"{n['label']}: {json.dumps(n['note'], sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
