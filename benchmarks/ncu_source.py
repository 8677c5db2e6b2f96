"""Where one kernel's instructions and warp stalls go, from an Nsight Compute source page (SASS) saved as CSV.

    ncu --set full --import-source yes -k regex:decode_mma --launch-count 1 -o prof \\
        python -m benchmarks.ops.paged_decode --once --shapes 256x244 --group 8 --prompt 116 --pools auto
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m benchmarks.ncu_source sass.csv [--top 15]

Prints the instructions executed (warp-level) and the warp-stall samples by opcode, the samples by stall reason, and
how many distinct instructions ran each number of times: a loop's body shows as many instructions sharing one count
(its trip count over all warps), so the instructions of one iteration can be read off the counts.
"""
from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
STALL = "stall_"        # the per-reason sample columns; their "(Not Issued)" twins are left out


@dataclass
class Profile:
    """One kernel's source page, summed."""

    kernel: str
    by_opcode: dict[str, list[int]] = field(default_factory=dict)   # opcode -> [executed, samples]
    by_stall: Counter = field(default_factory=Counter)              # reason -> samples
    by_count: Counter = field(default_factory=Counter)              # times run -> distinct instructions

    @property
    def executed(self) -> int:
        return sum(e for e, _ in self.by_opcode.values())

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.by_opcode.values())


def opcode(source: str) -> str:
    """The opcode of one SASS line without its predicate and modifiers: '@!P1 BRA 0x..' -> 'BRA', 'IMAD.WIDE.U32 ..'
    -> 'IMAD'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def _number(text: str) -> int:
    try:
        return int(float(text.replace(",", "")))
    except ValueError:   # "-" or empty: a column that does not apply to this instruction
        return 0


def read(path: str | Path) -> Profile:
    """The source page of the first kernel in `path` (ncu --page source --csv --print-source sass)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    if len(lines) < 2 or not lines[0] or lines[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source page (its first line names the kernel: 'Kernel Name',...)")
    header = lines[1]
    missing = [c for c in ("Source", EXECUTED, SAMPLES) if c not in header]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)} (export with --page source --print-source sass)")
    col = {name: i for i, name in enumerate(header)}
    stalls = [c for c in header if c.startswith(STALL) and "Not Issued" not in c]
    prof = Profile(kernel=lines[0][1] if len(lines[0]) > 1 else "")
    for row in lines[2:]:
        if len(row) < len(header):
            if row and row[0] == "Kernel Name":   # a second kernel's page: only the first is read
                break
            continue
        executed, samples = _number(row[col[EXECUTED]]), _number(row[col[SAMPLES]])
        entry = prof.by_opcode.setdefault(opcode(row[col["Source"]]), [0, 0])
        entry[0] += executed
        entry[1] += samples
        prof.by_count[executed] += 1
        for c in stalls:
            prof.by_stall[c[len(STALL):]] += _number(row[col[c]])
    return prof


def report(prof: Profile, top: int = 15) -> str:
    def share(part: int, whole: int) -> str:
        return f"{100 * part / whole:.1f}%" if whole else "-"

    executed = prof.executed
    out = [prof.kernel, f"instructions executed {executed:,}, stall samples {prof.samples:,}", "",
           "| opcode | executed | share | samples | share |", "|---|---|---|---|---|"]
    ranked = sorted(prof.by_opcode.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    for op, (n_exec, samples) in ranked[:top]:
        out.append(f"| {op} | {n_exec:,} | {share(n_exec, executed)} | {samples:,} | "
                   f"{share(samples, prof.samples)} |")
    stall_total = sum(prof.by_stall.values())
    out += ["", "| stall reason | samples | share |", "|---|---|---|"]
    for reason, n in sorted(prof.by_stall.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        out.append(f"| {reason} | {n:,} | {share(n, stall_total)} |")
    out += ["", "| times run | instructions | executed | share |", "|---|---|---|---|"]
    for times, n in sorted(prof.by_count.items(), key=lambda kv: (-kv[0] * kv[1], -kv[0]))[:top]:
        out.append(f"| {times:,} | {n} | {times * n:,} | {share(times * n, executed)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > CSV")
    ap.add_argument("--top", type=int, default=15, help="rows a table")
    args = ap.parse_args(argv)
    print(report(read(args.csv), args.top))


if __name__ == "__main__":
    main()
