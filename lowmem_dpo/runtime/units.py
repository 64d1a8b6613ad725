"""Sizes in bytes: the binary units, `fmt` for messages and `parse_size` for budgets such as 12GiB."""

from __future__ import annotations

import re

from lowmem_dpo.runtime.errors import UserError

GiB = 1 << 30
MiB = 1 << 20


def fmt(n: int | float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


# Binary units (KiB, MiB, GiB, TiB, and K, M, G, T alone: powers of 1024, as torch and nvidia-smi count) and
# decimal ones (KB, MB, GB, TB: powers of 1000, as disks are sold): 12GB is 11.18 GiB.
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": MiB, "mib": MiB, "mb": 10 ** 6,
         "g": GiB, "gib": GiB, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}
SIZE_UNITS = "GiB or G = 2^30 bytes, GB = 10^9 bytes (12GB is 11.18 GiB)"


def size_note(text: str) -> str | None:
    """How a size's unit was read, for the log, when it could be misread: a decimal unit ('12GB = 12 x 10^9 bytes
    = 11.18 GiB') or a letter alone ('12G = 12 GiB'); None for KiB, MiB, GiB, TiB, which fmt shows as written."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT][bB]?)\s*", text or "")
    if not match:
        return None
    number, unit = match.group(1), match.group(2)[0].upper()
    binary = f"{number}{unit}iB = {number} x 2^{10 * 'KMGT'.index(unit) + 10} bytes"
    if len(match.group(2)) == 1:
        return f"{text.strip()} = {number} {unit}iB ({unit} alone is binary: {binary})"
    return (f"{text.strip()} = {number} x 10^{3 * 'KMGT'.index(unit) + 3} bytes = "
            f"{fmt(float(number) * UNITS[match.group(2).lower()])} ({unit}B is decimal; {binary})")


def parse_size(text: str, what: str = "--budget") -> int:
    """'12GiB', '11.5GB', '12000MiB', '12G' (= GiB), or plain bytes (UNITS)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise UserError(f"{what} {text!r}: expected a size such as 12GiB, 11.5GB, 12000MiB or a number of bytes "
                        f"({SIZE_UNITS})")
    if not match.group(2) and float(match.group(1)) < MiB:  # "12" meant as GiB would plan for 12 bytes
        raise UserError(f"{what} {text!r}: a size without a unit is a number of bytes, and {match.group(1)} bytes "
                        f"is no budget; write the unit, e.g. {match.group(1)}GiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])
