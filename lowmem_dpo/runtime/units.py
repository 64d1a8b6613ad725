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


def parse_size(text: str, what: str = "--budget") -> int:
    """'12GiB', '11.5GB', '12000MiB', '12G' (= GiB), or plain bytes."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": MiB, "mib": MiB, "mb": 10 ** 6,
             "g": GiB, "gib": GiB, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in units or float(m.group(1)) <= 0:
        raise UserError(f"{what} {text!r}: expected a size such as 12GiB, 11.5GB, 12000MiB or a number of bytes")
    if not m.group(2) and float(m.group(1)) < MiB:  # "12" meant as GiB would plan for 12 bytes
        raise UserError(f"{what} {text!r}: a size without a unit is a number of bytes, and {m.group(1)} bytes is no "
                        f"budget; write the unit, e.g. {m.group(1)}GiB")
    return int(float(m.group(1)) * units[m.group(2).lower()])
