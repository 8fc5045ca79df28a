"""JSON for every core type, with a `kind` and a `schema_version`.

A file written by `dump` looks like `{"kind": "graph", "schema_version": 1, ...fields}`. Loading
checks the kind and the version first (a file from a newer hetplan is refused with a message
that says so), then validates the fields with pydantic against the dataclasses themselves, so
that the checks in their `__post_init__` run on load too. Errors name the file and the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pydantic

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError, InputError, shown
from hetplan.graph import Graph
from hetplan.plan import Estimate, Plan, twice_placed

SCHEMA_VERSION = 1
# hetplan's own files nest a handful of levels (a plan's estimate, a node's times); anything deeper is
# not one of them, and refusing it here keeps the recursive code after parsing (pydantic, `freeze`,
# `plain`) clear of Python's recursion limit.
MAX_DEPTH = 64
KINDS: Mapping[str, type] = {"graph": Graph, "cluster": Cluster, "plan": Plan, "estimate": Estimate}
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}


def plain(value: Any) -> Any:
    """Dataclasses, mappings and tuples as JSON-ready dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise HetplanError(f"cannot write {value!r} to JSON")
    return value


def finite_or_null(value: Any) -> Any:
    """A JSON value with every non-finite number made null: what a report says of a run whose
    loss became NaN (JSON has no NaN, and `allow_nan=False` refused the whole summary)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """The JSON-ready dict of a Graph, Cluster, Plan or Estimate."""
    kind = _KIND_OF.get(type(obj))
    if kind is None:
        raise TypeError(f"no JSON form for {type(obj).__name__}")
    return {"kind": kind, "schema_version": SCHEMA_VERSION, **plain(obj)}


def dumps(obj: Any) -> str:
    return json.dumps(to_dict(obj), indent=1, allow_nan=False)


def dump(obj: Any, path: str | os.PathLike) -> None:
    """Write a hetplan object as JSON, atomically."""
    atomic_write_text(Path(path), dumps(obj) + "\n")


def check_output(path: str | os.PathLike, inputs: Sequence[str | os.PathLike | None] = ()) -> Path:
    """Refuse an output path that is not a regular file or a new path (a device such as
    /dev/null, a FIFO, a directory, a symbolic link), or that is an input of the same command:
    writing there would replace what the user did not mean to lose."""
    out = Path(path)
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise InputError(f"{out}: cannot check the output path ({exc.strerror})") from None
    if stat.S_ISLNK(mode):
        raise InputError(f"{out}: is a symbolic link; hetplan does not write through or over links: give the file it "
                         "points to, or another path")
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device or a FIFO)"
        raise InputError(f"{out}: is {kind}; give a file path to write")
    for given in inputs:
        if given is not None and Path(given).exists() and os.path.samefile(given, out):
            raise InputError(f"{out}: is also an input of this command; write the result to another file")
    return out


def check_output_dir(path: str | os.PathLike, what: str = "the folder") -> Path:
    """Prove that the folder a command writes into takes a file, before any work: a path under a
    file, a read-only file system, no permission or a full disk is one line, not a traceback from
    deep inside the command. It leaves things as they were (folders it made go again): the
    command makes the folder when it writes, so a later refusal leaves nothing behind."""
    folder = Path(path)
    probe = folder / f".hetplan-write-test-{os.getpid()}"
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"hetplan")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"{folder}: cannot write {what} there ({exc.strerror or exc}); give another folder") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
            for p in made:
                p.rmdir()
    return folder


def atomic_write(path: Path, write: Callable[[Path], None], what: str = "the file") -> None:
    """`write(tmp)` into a temporary file beside `path`, then rename it over `path`, so a reader
    never sees half a file; when writing fails (a full disk, no permission, a read-only file
    system) the temporary file goes too, `path` is left as it was, and the error is one line."""
    check_output(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise InputError(f"{path}: cannot write {what} ({exc.strerror or exc})") from None


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write` of a text."""
    atomic_write(path, lambda tmp: tmp.write_text(text))


@cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _said(err: Mapping[str, Any], kind: str) -> str:
    """pydantic's message about a field, in the words of a hetplan file."""
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"not a field of a hetplan {kind} file; remove it, or check its spelling"
    given = err.get("input")
    if isinstance(given, str) and err["type"] in ("int_type", "float_type", "bool_type"):
        return f"{err['msg']}, got the text {shown(given)}: write it without quotes"
    return err["msg"]


def from_dict(data: Any, *, source: str = "<json>", expect: str | None = None) -> Any:
    """Rebuild a typed object from `to_dict`'s output; `expect` names the kind wanted."""
    if not isinstance(data, Mapping):
        raise InputError(f"{source}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise InputError(f"{source}: kind is {shown(kind)}; a hetplan file has kind one of {', '.join(KINDS)}")
    if expect is not None and kind != expect:
        raise InputError(f"{source}: this is a {kind} file, but a {expect} is needed here")
    version = data.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InputError(f"{source}: schema_version is {shown(version)}; expected a whole number")
    if version > SCHEMA_VERSION:
        raise InputError(
            f"{source}: written with schema_version {version}, but this hetplan reads up to "
            f"{SCHEMA_VERSION}: upgrade hetplan"
        )
    if version < 1:
        raise InputError(f"{source}: schema_version {version} is not a valid version")
    fields = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
    try:
        # strict, from the JSON text: a number must be a number and a switch a switch ("4" and
        # "yes" are mistakes to name, not to read as 4 and True), and a list stands for a tuple
        obj = _adapter(KINDS[kind]).validate_json(json.dumps(fields), strict=True)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        cause = err.get("ctx", {}).get("error")
        msg = str(cause) if isinstance(cause, HetplanError) else _said(err, kind)
        loc = _loc(err["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InputError(f"{source}: {loc + ': ' if loc else ''}{msg}{more}") from None
    except OverflowError:  # a check in a __post_init__ on an int beyond the largest float
        raise InputError(f"{source}: a number is too large to compute with; hetplan's numbers fit in a "
                         "float (below 1.8e308)") from None
    twice = twice_placed(obj) if isinstance(obj, Plan) else []
    if twice:
        raise InputError(f"{source}: {twice[0]}")
    return obj


def loads(text: str, *, source: str = "<json>", expect: str | None = None) -> Any:
    return from_dict(parse_json(text, source), source=source, expect=expect)


def parse_json(text: str, source: str) -> Any:
    """Parsed JSON; text that is not JSON, or that hetplan could not walk safely, is an `InputError`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise InputError(f"{source}: not valid JSON: nested more than Python can parse; hetplan files nest "
                         f"at most {MAX_DEPTH} levels") from None
    except ValueError:  # Python converts at most 4300 digits of an integer
        raise InputError(f"{source}: not valid JSON: a number has more digits than Python reads; write "
                         "numbers of a usual size") from None
    check_depth(data, source)
    return data


def check_depth(data: Any, source: str) -> None:
    """Refuse data nested deeper than `MAX_DEPTH`, or that contains itself (YAML aliases can).

    Iterative, and a list or mapping reached again through an alias is walked again only when
    reached deeper, so an alias bomb costs no more than its text."""
    deepest: dict[int, int] = {}
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if not isinstance(obj, list | dict) or deepest.get(id(obj), 0) >= depth:
            continue
        if depth > MAX_DEPTH:
            raise InputError(f"{source}: nested more than {MAX_DEPTH} levels deep (or an alias refers to "
                             "itself); hetplan files nest a few levels")
        deepest[id(obj)] = depth
        stack.extend((child, depth + 1) for child in (obj.values() if isinstance(obj, dict) else obj))


def is_hetplan_file(data: Any) -> bool:
    """True for what `dump` writes; False for a hand-written description (a cluster spec)."""
    return isinstance(data, Mapping) and "schema_version" in data


# The largest hetplan file read: a graph of a 100,000-node model profiled on ten device types is
# some 100 MB; a bigger file is the wrong file, refused before it is read into memory.
MAX_JSON_BYTES = 256 << 20


def read_json(path: str | os.PathLike) -> Any:
    """The parsed JSON of a file; a missing, unreadable, too big or broken file is an `InputError`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise InputError(f"{path}: {size / 2**20:.0f} MiB, more than any hetplan file holds "
                             f"({MAX_JSON_BYTES >> 20} MiB at most); is it the right file?")
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise InputError(not_utf8(path, exc)) from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    return parse_json(text, str(path))


def not_utf8(path: str | os.PathLike, exc: UnicodeDecodeError) -> str:
    return f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); save it as UTF-8 JSON or YAML"


def load(path: str | os.PathLike, expect: str | None = None) -> Any:
    return from_dict(read_json(path), source=str(path), expect=expect)
