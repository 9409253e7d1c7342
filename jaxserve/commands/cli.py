"""`jaxserve` console entry point: absl-flag subcommands.

Each subcommand lives in `jaxserve/commands/<name>.py` with `define_flags(fv)` and `run(fv) -> int`;
it gets a FlagValues of its own, so subcommands never clash over flag names. A command with the
engine flags has them checked together once they are parsed (engine_flags.settings_problem): a
setting that cannot work exits 2, naming its flag, before the command runs. A command with modes
(`jaxserve bench serve`) lists them in its module's `MODES`: {mode: (module, help)}, each mode
module with the same two functions.
"""
from __future__ import annotations

import importlib
import os
import sys

from absl import flags

from jaxserve import platforms
from jaxserve.commands import engine_flags

SUBCOMMANDS = {
    "convert": "convert a Hugging Face folder or a GGUF file into a jaxserve checkpoint",
    "generate": "batch generation: JSONL prompts in, JSONL completions out",
    "serve": "OpenAI-compatible HTTP server",
    "plan": "memory planner: weights, KV cache pages and maximum concurrency",
    "bench": "benchmarks: serve (an HTTP server under load), throughput and latency (in process)",
}


def _usage() -> str:
    lines = ["usage: jaxserve <command> [--flags]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "Run `jaxserve <command> --help` for the flags of one command."]
    return "\n".join(lines)


def _mode_usage(name: str, modes: dict[str, tuple[str, str]], given: str | None) -> int:
    """The modes of a command with modes; exit code 0 for --help, else 2 (no or unknown mode)."""
    asked = given in ("-h", "--help", "help")
    listing = "\n".join(f"  {mode:<11} {text}" for mode, (_, text) in modes.items())
    problem = "" if asked else (f"unknown mode {given!r}\n\n" if given else "a mode is needed\n\n")
    print(f"{problem}usage: jaxserve {name} <mode> [--flags]\n\nmodes:\n{listing}\n\n"
          f"Run `jaxserve {name} <mode> --help` for the flags of one mode.", file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if len(argv) >= 2 else 2
    name = argv[1]
    if name not in SUBCOMMANDS:
        print(f"jaxserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    platforms.default_to_cpu_without_gpu()
    # transformers' advice to install PyTorch (printed at its import without torch) is not for
    # jaxserve, which uses only its tokenizers and configs.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    module = importlib.import_module(f"jaxserve.commands.{name}")
    if hasattr(module, "MODES"):
        if len(argv) < 3 or argv[2] not in module.MODES:
            return _mode_usage(name, module.MODES, argv[2] if len(argv) >= 3 else None)
        module = importlib.import_module(module.MODES[argv[2]][0])
        name, argv = f"{name} {argv[2]}", argv[:1] + [f"{name} {argv[2]}"] + argv[3:]
    fv = flags.FlagValues()
    module.define_flags(fv)
    flags.DEFINE_boolean("help", False, "show the flags of this command", flag_values=fv, short_name="h")
    try:
        fv([f"jaxserve {name}"] + argv[2:])
    except flags.Error as e:
        print(f"jaxserve {name}: {e}", file=sys.stderr)
        return 2
    if fv.help:
        print(f"jaxserve {name}: {SUBCOMMANDS.get(name) or module.__doc__.splitlines()[0]}\n")
        print(fv.get_help())
        return 0
    problem = engine_flags.settings_problem(fv)
    if problem is not None:
        print(f"jaxserve {name}: {problem}", file=sys.stderr)
        return 2
    return int(module.run(fv) or 0)


if __name__ == "__main__":
    sys.exit(main())
