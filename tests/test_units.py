import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.errors import HetplanError
from hetplan.units import (
    fmt_bytes,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
    parse_flops,
)


@pytest.mark.parametrize("text,expected", [
    ("40GiB", 40 * 2**30), ("16GB", 16 * 10**9), ("512 MiB", 512 * 2**20), ("1.5TB", 1.5e12),
    ("64KiB", 65536), ("100B", 100), ("7", 7), (123, 123), ("2e3", 2000), ("1 byte", 1),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("300GB/s", 300e9), ("10Gbit/s", 1.25e9), ("10Gb/s", 1.25e9), ("25Gbps", 3.125e9),
    ("32GB/s", 32e9), ("1GiB/s", 2.0**30), ("100Mbit/s", 12.5e6), (5e9, 5e9), ("2TB/s", 2e12),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [
    ("5us", 5e-6), ("5µs", 5e-6), ("1.5ms", 1.5e-3), ("2s", 2.0), ("100ns", 1e-7), (0.25, 0.25), ("1min", 60),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


def test_parse_flops():
    assert parse_flops("19.5TFLOP/s") == 19.5e12
    assert parse_flops("312 TFLOPS") == 312e12
    assert parse_flops("64GFLOP/s") == 64e9
    assert parse_flops(1e12) == 1e12


@pytest.mark.parametrize("parser,text,needle", [
    (parse_bytes, "-5GiB", "negative"),
    (parse_bytes, "lots", "cannot read"),
    (parse_bytes, "5XB", "unknown size unit"),
    (parse_bytes, "5G", "no unit after the prefix"),
    (parse_bytes, "nan", "cannot read"),
    (parse_bytes, True, "expected a number"),
    (parse_bandwidth, "10GB", "unknown bandwidth unit"),
    (parse_bandwidth, "-1GB/s", "negative"),
    (parse_duration, "5 parsecs", "unknown time unit"),
    (parse_flops, "5 TB/s", "unknown FLOP-rate unit"),
])
def test_bad_units_name_the_field(parser, text, needle):
    with pytest.raises(HetplanError) as err:
        parser(text, "devices[3].memory")
    assert str(err.value).startswith("devices[3].memory: ")
    assert needle in str(err.value)


@given(st.integers(0, 2**50), st.sampled_from(["B", "KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_bytes_scale_with_prefix(n, unit):
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    assert parse_bytes(f"{n}{unit}") == pytest.approx(n * scale, rel=1e-12)


def test_fmt_bytes_uses_binary_units():
    assert fmt_bytes(17.2 * 2**30) == "17.2 GiB"
    assert fmt_bytes(512) == "512 B"
