"""How an engine setting is declared and checked (no jax): `setting` declares an EngineConfig field
with its `Flag` (help, choices, bounds, vLLM alias), `bound_problem` checks a value against them,
and `parse_bucket_sizes` reads a bucket list (--decode_buckets, --prefill_buckets). A setting that
cannot work is a `SettingError` whose message names the flag (jaxserve.config.EngineConfig.check).
"""
from __future__ import annotations

import dataclasses
from typing import Any


class SettingError(ValueError):
    """An EngineConfig setting, or a combination of them, that cannot work; the message names the
    flag(s) (`--name`), so a command line fails with it before anything loads."""


class BucketListError(SettingError):
    """An explicit bucket list (--decode_buckets, --prefill_buckets) that cannot work."""


def parse_bucket_sizes(value: Any, flag: str, largest: int, largest_flag: str) -> tuple[int, ...]:
    """The sizes of an explicit bucket list: `value` is the flag's text ("8,16,32") or a sequence
    of ints; ascending, each at least 1, the last equal to `largest` (the limit a step may reach,
    the value of --`largest_flag`: a step that size must fit, and no bucket beyond it is ever used).
    Raises BucketListError naming --`flag` and what is wrong."""
    text = value if isinstance(value, str) else format_bucket_sizes(value)
    try:
        sizes = tuple(int(item.strip()) for item in text.split(","))
    except ValueError:
        raise BucketListError(f"--{flag}={text!r}: expected comma-separated positive integers") from None
    if min(sizes) < 1:
        raise BucketListError(f"--{flag}={text!r}: every size must be at least 1")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise BucketListError(f"--{flag}={text!r}: sizes must be strictly ascending (no repeats)")
    if sizes[-1] != largest:
        raise BucketListError(f"--{flag}={text!r}: the largest size must be --{largest_flag}={largest} "
                              f"(a step of that size must fit, and none is larger)")
    return sizes


def format_bucket_sizes(sizes) -> str:
    """The flag value of a bucket list: its sizes, comma-separated (parse_bucket_sizes reads it)."""
    try:
        return ",".join(str(size) for size in sizes)
    except TypeError:
        raise BucketListError(f"a bucket list must be comma-separated text or a sequence of sizes, "
                              f"got {sizes!r}") from None


@dataclasses.dataclass(frozen=True)
class Flag:
    """How an EngineConfig field is a flag of `jaxserve serve`, `generate` and `plan`
    (jaxserve.commands.engine_flags defines one per field that has a Flag, of the field's type:
    int, float, bool, str, or str with `choices` an enum, a str for a tuple of ints, which
    EngineConfig parses, and a repeatable str with `repeated`; every flag defaults to None, which
    keeps the field's default). Its help ends
    "(default: ...)": `unset` where given, else the field's default; nothing for a None default
    without `unset`. `choices`, `minimum` and `maximum` bound the field (EngineConfig.check, and
    absl's own bounds at parsing)."""
    help: str
    unset: str | None = None  # what an unset flag means, where the field's default does not say it
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # the value must be above `minimum`, not equal to it
    vllm_name: str | None = None  # vLLM's flag name for the setting (absl's underscore form), an alias
    repeated: bool = False  # a list of strings: the flag may be given several times (absl's multi_string)


def setting(default, help: str, **flag) -> Any:
    """An EngineConfig field with its flag (`flag`: the other fields of Flag)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def bound_problem(name: str, value: Any, flag: Flag) -> str | None:
    """What is wrong with `value` for the flag --`name` under its Flag's choices and bounds, or None."""
    if flag.choices is not None:
        return None if value in flag.choices else (
            f"unsupported {name} {value!r}: --{name} must be one of {', '.join(flag.choices)}")
    low, high, open_low = flag.minimum, flag.maximum, flag.exclusive_minimum
    if not ((low is not None and (value < low or (open_low and value == low))) or (high is not None and value > high)):
        return None
    if low is not None and high is not None:
        bound = f"in {'(' if open_low else '['}{_number(low)}, {_number(high)}]"
    else:
        bound = f"{'>' if open_low else '>='} {_number(low)}" if low is not None else f"<= {_number(high)}"
    return f"--{name} must be {bound}, got {_number(value)}"


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
