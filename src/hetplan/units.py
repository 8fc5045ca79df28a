"""Human units for sizes, bandwidths, durations and FLOP rates.

Cluster files are written by people: `40GiB`, `16GB`, `10Gbit/s`, `300GB/s`, `5us`,
`19.5TFLOP/s`. Decimal prefixes (k, M, G, T, P) are powers of 1000 and binary ones (Ki, Mi, Gi,
Ti) powers of 1024. In a bandwidth a capital `B` is a byte and a small `b` (or `bit`) is a bit,
so `10Gbit/s`, `10Gb/s` and `10Gbps` are all 1.25e9 bytes per second. A plain number is taken in
the base unit (bytes, bytes per second, seconds, FLOP/s).

Every parser takes the name of the field it reads so that its error names it.
"""

from __future__ import annotations

import math
import re

from hetplan.errors import HetplanError

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_PREFIX = {**_DECIMAL, **_BINARY}

_NUMBER = r"(?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_NUM_UNIT = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>\S*)\s*$")

_SIZE_UNIT = re.compile(r"^(?P<prefix>[kKMGTP]i?)?(?P<base>B|bytes?)?$")
_BW_UNIT = re.compile(r"^(?P<prefix>[kKMGTP]i?)?(?P<base>B|b|bit|byte)(?:/s|ps)$")
# Sub-second units are divisors so that "5us" is exactly 5e-06, not 4.9999999999999996e-06.
_TIME_UNIT = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0}
_TIME_DIVISOR = {"ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_FLOPS_UNIT = re.compile(r"^(?P<prefix>[kKMGTP])?(?:FLOP/s|FLOPS|FLOPs|flop/s|flops)$")


def _split(value: object, field: str, examples: str) -> tuple[float, str]:
    if isinstance(value, bool):
        raise HetplanError(f"{field}: expected a number or a string such as {examples}, got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _NUM_UNIT.match(value)
        if not match:
            raise HetplanError(f"{field}: cannot read {value!r}; write it like {examples}")
        number, unit = float(match["num"]), match["unit"]
    else:
        raise HetplanError(f"{field}: expected a number or a string such as {examples}, got {value!r}")
    if not math.isfinite(number):
        raise HetplanError(f"{field}: {value!r} is not a finite number")
    if number < 0:
        raise HetplanError(f"{field}: {value!r} is negative; it must be >= 0")
    return number, unit


def parse_bytes(value: object, field: str = "size") -> int:
    """`40GiB`, `16GB`, `512 MiB`, `1e9` -> bytes (an int)."""
    examples = "'40GiB', '16GB' or '512MiB'"
    number, unit = _split(value, field, examples)
    match = _SIZE_UNIT.match(unit)
    if not match or (unit and not match["base"] and not match["prefix"]):
        raise HetplanError(f"{field}: unknown size unit {unit!r} in {value!r}; write it like {examples}")
    if match["prefix"] and not match["base"]:
        raise HetplanError(f"{field}: {value!r} has no unit after the prefix; write it like {examples}")
    return int(round(number * _PREFIX[match["prefix"] or ""]))


def parse_bandwidth(value: object, field: str = "bandwidth") -> float:
    """`300GB/s`, `10Gbit/s`, `10Gbps`, `25Gb/s`, `1.5e10` -> bytes per second."""
    examples = "'300GB/s', '10Gbit/s' or '25Gbps'"
    number, unit = _split(value, field, examples)
    if unit == "":
        return number
    match = _BW_UNIT.match(unit)
    if not match:
        raise HetplanError(
            f"{field}: unknown bandwidth unit {unit!r} in {value!r}; write it like {examples}"
        )
    scale = _PREFIX[match["prefix"] or ""]
    if match["base"] in ("b", "bit"):
        scale /= 8.0
    return number * scale


def parse_duration(value: object, field: str = "latency") -> float:
    """`5us`, `1.5ms`, `2s`, `100ns` -> seconds."""
    examples = "'5us', '1.5ms' or '2s'"
    number, unit = _split(value, field, examples)
    if unit not in _TIME_UNIT:
        raise HetplanError(f"{field}: unknown time unit {unit!r} in {value!r}; write it like {examples}")
    if unit in _TIME_DIVISOR:
        return number / _TIME_DIVISOR[unit]
    return number * _TIME_UNIT[unit]


def parse_flops(value: object, field: str = "peak_flops") -> float:
    """`19.5TFLOP/s`, `312 TFLOPS`, `1.5e13` -> FLOP per second."""
    examples = "'19.5TFLOP/s' or '312TFLOPS'"
    number, unit = _split(value, field, examples)
    if unit == "":
        return number
    match = _FLOPS_UNIT.match(unit)
    if not match:
        raise HetplanError(f"{field}: unknown FLOP-rate unit {unit!r} in {value!r}; write it like {examples}")
    return number * _DECIMAL[match["prefix"] or ""]


def fmt_bytes(n: float) -> str:
    """Binary units, as memory is sold and reported by nvidia-smi: 17.2 GiB."""
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_bandwidth(bps: float) -> str:
    if math.isinf(bps):
        return "local"
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} B/s"


SECONDS_PER_MINUTE, MINUTES_PER_HOUR = 60.0, 60.0  # for showing a duration (prices per hour: `cost.formulas`)


def fmt_seconds(s: float) -> str:
    hour = SECONDS_PER_MINUTE * MINUTES_PER_HOUR
    if s >= hour:
        return f"{s / hour:.3g} h"
    if s >= 1000.0:
        return f"{s / SECONDS_PER_MINUTE:.3g} min"
    if s >= 1.0:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} us"
    if s == 0:
        return "0 s"
    return f"{s * 1e9:.3g} ns"


def fmt_flops(f: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if f >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f:.3g} FLOP/s"
