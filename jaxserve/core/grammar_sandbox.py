"""A child process that tries each new grammar before the server compiles it (no jax).

llguidance compiles a grammar in native code: a long enough chain of rules overflowed the stack of
the thread compiling it and killed the whole server (SIGSEGV), and a regex like `(f{1000}){1000}`
took a second and 150 MiB to build its first token mask. So every grammar the server has not
compiled yet is first compiled here, in a process of its own, and its first mask computed; the
parent watches the child's time and memory while it works:
- the child dies (a crash): the grammar is refused, and a new child starts for the next one;
- it runs past `timeout_s`, or its resident memory grows past `max_bytes`: the child is killed,
  the grammar refused;
- llguidance reports an error (its parser limits, a bad pattern): the grammar is refused with it.
A grammar that passes is compiled by the server as here (on a thread with the same stack size),
and the memory it took here is what the server's grammar cache counts for it.

Protocol (one JSON object per line): the parent sends {"tokenizer": tokenizer.json text,
"vocab_size", "eos_token_ids"} once, then {"kind", "spec"} per job (a constraint: `grammar_text`);
the child answers {"ready": true}, then per job {"ok": true, "grammar": llguidance grammar text,
"bytes": n, "seconds": s} or {"ok": false, "error": message}. The translation to llguidance's
grammar happens in the child too: a long GBNF grammar takes seconds there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from jaxserve import environment

COMPILE_STACK_BYTES = 256 << 20  # the fuzz test's longest rule chains under the 64 KB limit need ~16 MiB
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 128 << 20  # a JSON schema's grammar takes a few MiB; `(f{1000}){1000}` 150
_POLL_S = 0.01
_PAGE = os.sysconf("SC_PAGE_SIZE")


class GrammarRejected(Exception):
    """The grammar cannot be used: the message says why (for the client's 400). `transient`: the
    sandbox failed rather than the grammar (it may pass when sent again)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def run_on_big_stack(function, *args):
    """`function(*args)` on a new thread with COMPILE_STACK_BYTES of stack; its result or exception."""
    result: dict = {}

    def target():
        try:
            result["value"] = function(*args)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=target, name="jaxserve-grammar-compile", daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (this one by default), from /proc; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


# JSON as json.dumps writes it (", " and ": ", no other whitespace): a model cannot wander off
# into whitespace, and every output of a bounded schema ends. A schema may override this with
# llguidance's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(kind: str, spec) -> str:
    """The llguidance grammar of a constraint (structured_output.StructuredOutputParams' kind and
    spec). Raises ValueError or TypeError for a spec llguidance cannot translate."""
    import llguidance  # imported on first use: a machine without it serves everything but grammars

    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "regex":  # \d is [0-9] (as in JSON Schema's patterns), not every Unicode digit
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec, 'd')}/")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark (slow for long ones)


def build_matcher(tokenizer, grammar: str):
    """An llguidance matcher for `grammar`, its first token mask computed (which builds the lexer's
    first states: where a pathological regex spends its time and memory). Raises GrammarRejected
    with llguidance's first error line."""
    import llguidance  # imported on first use: a machine without it serves everything but grammars

    limits = llguidance.LLParserLimits(verbose_errors=False)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if not matcher.is_error():  # a mask does not advance the matcher; the states it builds are kept
        mask = np.zeros(((tokenizer.vocab_size + 31) // 32,), np.int32)
        try:
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        except Exception as e:  # llguidance raises for a lexer or parser limit met while computing it
            raise GrammarRejected(first_line(e)) from None
    if matcher.is_error():
        raise GrammarRejected(first_line(matcher.get_error()))
    return matcher


def first_line(error) -> str:
    """llguidance's message on one line: its first lines (the grammar excerpt after them is left out)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()][:4]
    return " ".join(lines)[:500] or "invalid"


class GrammarSandbox:
    """The parent's handle on the child; `check` is thread-safe (one grammar at a time)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self._hello = json.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size,
                                  "eos_token_ids": list(eos_token_ids)}) + "\n"
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._baseline = 0
        self.num_restarts = 0

    def _start(self) -> None:
        env = {**environment.process_environment(), "PYTHONUNBUFFERED": "1"}
        self._child = subprocess.Popen([sys.executable, "-m", "jaxserve.core.grammar_sandbox"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self._child.stdin.write(self._hello)
        self._child.stdin.flush()
        reply = self._child.stdout.readline()  # the tokenizer is built once per child (about a second)
        if not reply or not json.loads(reply).get("ready"):
            self._kill()
            raise RuntimeError("the grammar sandbox did not start")
        self._baseline = rss_bytes(self._child.pid)

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None
            self.num_restarts += 1

    def close(self) -> None:
        with self._lock:
            self._kill()

    def check(self, kind: str, spec) -> tuple[str, int]:
        """(llguidance grammar text, bytes it took to compile in the child) of a constraint;
        GrammarRejected if it cannot be used."""
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._child = None
                self._start()
            child = self._child
            try:
                child.stdin.write(json.dumps({"kind": kind, "spec": spec}) + "\n")
                child.stdin.flush()
                reply = self._wait(child)
            except OSError:  # the child died before reading the job (a broken pipe)
                self._kill()
                reply = {"ok": False, "error": "the grammar engine stopped; try again", "transient": True}
            if rss_bytes(child.pid) - self._baseline > self.max_bytes // 2:
                self._kill()  # memory the child kept after a big grammar: a fresh one for the next
        if not reply.get("ok"):
            raise GrammarRejected(reply.get("error") or "the grammar engine refused it", bool(reply.get("transient")))
        return reply["grammar"], int(reply["bytes"])

    def _wait(self, child: subprocess.Popen) -> dict:
        """The child's answer, watching its time and memory; kills it past either budget."""
        deadline = time.monotonic() + self.timeout_s
        ready = threading.Event()
        answer: list[str] = []

        def read():
            answer.append(child.stdout.readline())
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(_POLL_S):
            if time.monotonic() > deadline:
                self._kill()
                return {"ok": False, "error": f"it takes longer than {self.timeout_s:g} s to compile"}
            if rss_bytes(child.pid) - self._baseline > self.max_bytes:
                self._kill()
                return {"ok": False, "error": f"it needs more than {self.max_bytes >> 20} MiB to compile"}
        if not answer[0]:  # the child died: a crash in the grammar engine
            self._kill()
            return {"ok": False, "error": "it crashed the grammar engine"}
        return json.loads(answer[0])


def _translate_and_build(tokenizer, kind: str, spec):
    try:
        grammar = grammar_text(kind, spec)
    except (ValueError, TypeError) as e:
        raise GrammarRejected(first_line(e)) from None
    return grammar, build_matcher(tokenizer, grammar)


def _child_main() -> None:
    """The child: builds the tokenizer, then compiles one grammar per input line."""
    import llguidance  # imported on first use: a machine without it serves everything but grammars

    hello = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(hello["tokenizer"], n_vocab=hello["vocab_size"],
                                       eos_token=hello["eos_token_ids"] or None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        before, start = rss_bytes(), time.perf_counter()
        try:
            grammar, matcher = run_on_big_stack(_translate_and_build, tokenizer, job["kind"], job["spec"])
            reply = {"ok": True, "grammar": grammar, "bytes": max(rss_bytes() - before, len(grammar)),
                     "seconds": time.perf_counter() - start}
            del matcher
        except GrammarRejected as e:
            reply = {"ok": False, "error": str(e)}
        except Exception as e:  # llguidance's own exceptions (a grammar it cannot parse)
            reply = {"ok": False, "error": first_line(e)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _child_main()
