"""Multi-host serving (jaxserve.parallel.multihost) on this machine: several processes joined by
jax.distributed on 127.0.0.1, CPU devices, JAX's CPU collectives (gloo) between them.

Each job runs the real CLI (`jaxserve generate` / `jaxserve serve`) once per process with the
same flags; the tests compare its greedy output with one process at TP 1, kill a worker in the
middle of a stream, and read what each process logs about its share of the weights. Every job is
killed in a `finally` and uses free ports.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import requests

from jaxserve.parallel import multihost, sharding
from tests.tiny_models import copy_smollm2_tokenizer, make_tiny_hf_model

pytestmark = pytest.mark.slow  # processes joined by jax.distributed: out of `make test-quick`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--max_num_seqs=4", "--max_num_batched_tokens=64", "--max_model_len=128", "--num_pages=40"]
PROMPTS = [{"id": 1, "prompt": "The capital of France is"}, {"id": 2, "prompt": "def fibonacci(n):"},
           {"id": 3, "messages": [{"role": "user", "content": "Hi there"}]}]
HEARTBEAT_S = 3
LOST_PROCESS_BOUND_S = 20  # heartbeat timeout + a liveness round + scheduling on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One `jaxserve <command>` process per process id, joined on a free port; logs in files."""

    def __init__(self, tmp_path, command: str, num_processes: int, devices: int, flags: list[str], env=None):
        self.tmp_path, self.procs, self.logs = tmp_path, [], []
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
               "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **(env or {})}
        coordinator = f"127.0.0.1:{free_port()}"
        for i in range(num_processes):
            log = open(tmp_path / f"{command}-{i}.log", "w+")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxserve.commands.cli", command, *flags, f"--coordinator_address={coordinator}",
                 f"--num_processes={num_processes}", f"--process_id={i}"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))

    def log(self, i: int) -> str:
        self.logs[i].flush()
        with open(self.logs[i].name) as f:
            return f.read()

    def wait(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        codes = []
        for i, proc in enumerate(self.procs):
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"process {i} still runs after {timeout_s}s:\n{self.log(i)[-3000:]}") from None
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(10)
        for log in self.logs:
            log.close()


def _weights_line(log: str) -> tuple[float, float, float, float]:
    """(MiB on this process's devices, MiB in all, RSS before, RSS after loading) from a process's log."""
    m = re.search(r"weights loaded: ([\d.]+) MiB on this process's devices of ([\d.]+) MiB in all; "
                  r"RSS ([\d.]+) MiB -> ([\d.]+) MiB", log)
    assert m, log[-3000:]
    return tuple(float(g) for g in m.groups())


# ---- host side, no devices --------------------------------------------------------------------
def test_step_message_round_trip():
    rng = np.random.default_rng(0)
    message = multihost.StepMessage(
        "step", 1, (8, 32, 4), {"token_ids": rng.integers(0, 100, 40).astype(np.int32),
                                "decode_block_table": np.zeros((8, 4), np.int32)},
        {"temperature": rng.random(9).astype(np.float32), "token_bitmask": np.full((9, 3), -1, np.int32),
         "flag": np.array([True, False])}, None)
    back = multihost.unpack(multihost.pack(message))
    assert (back.kind, back.replica, back.bucket, back.prompt_rows) == ("step", 1, (8, 32, 4), None)
    for group in ("arrays", "sampling"):
        sent, got = getattr(message, group), getattr(back, group)
        assert list(sent) == list(got)
        for name in sent:
            assert got[name].dtype == sent[name].dtype and np.array_equal(got[name], sent[name])
    assert multihost.unpack(multihost.pack(multihost.StepMessage("stop"))).kind == "stop"
    # a large array of one value (the grammar bitmask without grammars) travels as that value
    ones = {"token_bitmask": np.full((64, 1536), -1, np.int32), "float": np.full(4096, 0.5, np.float32)}
    packed = multihost.pack(multihost.StepMessage("step", 0, (64, 0, 8), {}, ones, None))
    assert len(packed) < 500
    for name, array in multihost.unpack(packed).sampling.items():
        assert array.dtype == ones[name].dtype and np.array_equal(array, ones[name])


def test_join_options_flags_then_environment_then_cluster():
    env = {"JAXSERVE_COORDINATOR_ADDRESS": "h0:1234", "JAXSERVE_NUM_PROCESSES": "4", "JAXSERVE_PROCESS_ID": "2"}
    assert multihost.resolve_join_options(environ={}) is None
    opts = multihost.resolve_join_options(environ=env)
    assert (opts.coordinator_address, opts.num_processes, opts.process_id, opts.auto) == ("h0:1234", 4, 2, False)
    opts = multihost.resolve_join_options("h1:99", None, 3, environ=env)  # flags win, the rest from env
    assert (opts.coordinator_address, opts.num_processes, opts.process_id) == ("h1:99", 4, 3)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}
    assert multihost.resolve_join_options(environ=slurm).auto
    assert multihost.resolve_join_options(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    for args, message in [(("h:1", 2, 2), "must be in \\[0, 1\\]"), (("h:1", None, 0), "needs --num_processes"),
                          (("nohostport", 2, 0), "host:port"), ((None, 2, 1), "need --coordinator_address")]:
        with pytest.raises(ValueError, match=message):
            multihost.resolve_join_options(*args, environ={})
    with pytest.raises(ValueError, match="must be an integer"):
        multihost.resolve_join_options(environ={**env, "JAXSERVE_PROCESS_ID": "x"})
    with pytest.raises(ValueError, match="multiple of 3"):
        sharding.check_parallel_sizes(4, 1, 3)
    sharding.check_parallel_sizes(6, 2, 3)


def test_every_replica_spans_every_process():
    from jaxserve.parallel import sharding
    devices = [types.SimpleNamespace(id=p * 100 + i, process_index=p, platform="cpu")
               for p in range(2) for i in range(4)]
    grid = sharding._process_spanning_grid(devices, [0, 1], tp=4, dp=2)
    assert [[d.id for d in row] for row in grid] == [[0, 1, 100, 101], [2, 3, 102, 103]]
    assert [d.id for d in sharding._process_spanning_grid(devices, [0, 1], tp=8, dp=1)[0]] == \
        [0, 1, 2, 3, 100, 101, 102, 103]
    with pytest.raises(ValueError, match="needs 8 devices in each, but process 0 has 4"):
        sharding._process_spanning_grid(devices, [0, 1], tp=8, dp=2)


@pytest.mark.parametrize("command, flags, message", [
    ("serve", ["--num_processes=2", "--process_id=1"], "need --coordinator_address"),
    ("generate", ["--input=x", "--output=y", "--coordinator_address=127.0.0.1:1", "--num_processes=2",
                  "--process_id=0", "--tensor_parallel_size=3"], "must be a multiple of 2"),
    ("serve", ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=5"], "must be in"),
])
def test_cli_refuses_bad_combinations(command, flags, message):
    proc = subprocess.run([sys.executable, "-m", "jaxserve.commands.cli", command, *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


# ---- jobs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny8(tmp_path_factory) -> str:
    """A converted tiny random Llama with 8 query heads over 2 KV heads (TP 8 replicates KV heads)
    and SmolLM2's tokenizer."""
    from checkpoints.convert import convert_checkpoint

    hf_dir = str(tmp_path_factory.mktemp("tiny8_hf"))
    make_tiny_hf_model(hf_dir, vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=8,
                       num_q_heads=8, num_kv_heads=2)
    copy_smollm2_tokenizer(hf_dir)
    out_dir = str(tmp_path_factory.mktemp("tiny8") / "model")
    convert_checkpoint(hf_dir, out_dir)
    return out_dir


def _generate(tmp_path, model, name, num_processes=1, devices=1, flags=(), prompts=PROMPTS, env=None):
    """`jaxserve generate` greedy over `prompts` as a job; {id: token_ids} and the job's logs
    (`texts`: {id: text} of the last call)."""
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.out.jsonl"
    inp.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = [f"--model={model}", f"--input={inp}", f"--output={out}", "--max_tokens=10", "--progress=false",
            *SMALL, *flags]
    if num_processes == 1:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-m", "jaxserve.commands.cli", "generate", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs = [proc.stderr]
    else:
        job = Job(tmp_path, "generate", num_processes, devices, args, env)
        try:
            codes = job.wait(300)
            logs = [job.log(i) for i in range(num_processes)]
        finally:
            job.kill()
        assert codes == [0] * num_processes, "\n".join(log[-2000:] for log in logs)
    results, texts = {}, {}
    for line in out.read_text().splitlines():
        row = json.loads(line)
        assert row["finish_reason"] == "length", row
        results[row["id"]] = row["token_ids"]
        texts[row["id"]] = row["text"]
    _generate.texts = texts
    return results, logs


def test_two_processes_tp8_and_dp2_tp4_match_one_process(tmp_path, tiny8):
    reference, _ = _generate(tmp_path, tiny8, "tp1")
    assert len(reference) == len(PROMPTS)
    tp8, logs = _generate(tmp_path, tiny8, "tp8", 2, 4, ["--tensor_parallel_size=8"])
    assert tp8 == reference
    local, total, _, _ = _weights_line(logs[1])
    assert abs(local - total / 2) < 0.02 * total  # KV projections are expanded for TP 8, then split
    assert "stop after" in logs[1] and "the multi-host job failed" not in logs[0]
    # every step message as device broadcasts (the path of messages over 128 KiB)
    dp, logs = _generate(tmp_path, tiny8, "dp2tp4", 2, 4, ["--tensor_parallel_size=4", "--data_parallel_size=2"],
                         prompts=PROMPTS[:2], env={"JAXSERVE_MULTIHOST_KV_MAX_BYTES": "0"})
    assert dp == {k: reference[k] for k in dp} and len(dp) == 2
    assert logs[1].count("weights loaded") == 2  # one line per replica, each half on this process


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """A converted tiny random Qwen2-MoE (8 routed experts and a shared one) with SmolLM2's
    tokenizer; routed experts of intermediate size 1024, a third of the checkpoint's bytes."""
    from checkpoints.convert import convert_checkpoint
    from tests.test_moe import make_moe_model

    hf_dir = str(tmp_path_factory.mktemp("tiny_moe_hf"))
    make_moe_model(hf_dir, "qwen2_moe", vocab_size=49152, num_experts=8, moe_intermediate_size=1024)
    copy_smollm2_tokenizer(hf_dir)
    out_dir = str(tmp_path_factory.mktemp("tiny_moe") / "model")
    convert_checkpoint(hf_dir, out_dir)
    return out_dir


def _restored_bytes(log: str) -> float:
    """MiB one process read from the checkpoint while restoring its weights, from its log."""
    m = re.search(r"weights restored: ([\d.]+) MiB read from", log)
    assert m, log[-3000:]
    return float(m.group(1)) * 2**20


def test_two_processes_expert_parallel_match_one_process_and_restore_only_their_experts(tmp_path, tiny_moe):
    """TP 4 over 2 processes x 2 devices with --enable_expert_parallel: one process's greedy tokens;
    process p's devices hold experts [4p, 4p + 4) only, and it reads only their chunks."""
    from checkpoints.load import file_bytes_read, load_params
    from tests.test_moe import expert_bytes_read
    prompts = PROMPTS[:2]
    reference, _ = _generate(tmp_path, tiny_moe, "moe_tp1", prompts=prompts)
    ep, logs = _generate(tmp_path, tiny_moe, "moe_ep4", 2, 2, ["--tensor_parallel_size=4", "--enable_expert_parallel"],
                         prompts=prompts)
    assert ep == reference and len(ep) == 2
    experts_on_disk = sum(expert_bytes_read(tiny_moe, name, slice(0, 8))[0]
                          for name in ("w_gate_exps", "w_up_exps", "w_down_exps"))
    before = file_bytes_read()
    load_params(tiny_moe, "float32")  # here, on one device: every chunk
    read_all = file_bytes_read() - before
    assert experts_on_disk > 0.3 * read_all
    for p in range(2):
        held = re.search(r"; routed experts (.*) of 8\n", logs[p])
        assert held, logs[p][-3000:]
        assert sorted(held.group(1).split(", ")) == [f"{name} {4 * p}-{4 * p + 3}" for name in
                                                     ("w_down_exps", "w_gate_exps", "w_up_exps")], held.group(1)
        # the dense weights are read whole by every process (one chunk each); the experts half
        saved = read_all - _restored_bytes(logs[p])
        assert abs(saved - experts_on_disk / 2) < 0.05 * experts_on_disk, (p, saved, experts_on_disk)
    print(f"\nread from the checkpoint (MiB): {read_all / 2**20:.2f} by one process, "
          f"{[round(_restored_bytes(log) / 2**20, 2) for log in logs]} by each of 2; "
          f"routed experts {experts_on_disk / 2**20:.2f} of it")


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from checkpoints import default_model
    return default_model.resolve_model("smollm2")


# One sequence at a time, 16-token steps: the fewest shapes to compile at warm-up (13).
SERVE_FLAGS = ["--max_num_seqs=1", "--max_num_prefill_seqs=1", "--max_num_batched_tokens=16", "--max_model_len=160",
               "--num_pages=24",
               f"--heartbeat_timeout_s={HEARTBEAT_S}", "--step_timeout_s=60", "--no_web_ui"]


def _wait_healthy(url: str, job: Job, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, proc in enumerate(job.procs):
            assert proc.poll() is None, f"process {i} exited:\n{job.log(i)[-3000:]}"
        try:
            response = requests.get(url + "/health", timeout=2)
            if response.status_code == 200:
                return response.json()
        except requests.RequestException:
            pass
        time.sleep(1)
    raise AssertionError(f"no healthy server after {timeout_s}s:\n{job.log(0)[-3000:]}")


def _stream(url: str, body: dict, on_first_chunk=None, timeout_s: float = 120) -> tuple[str, list, float]:
    """Streams a completion: (text, error events, seconds from the first chunk to the end)."""
    text, errors, first = [], [], None
    with requests.post(url + "/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=timeout_s) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            text.append(event["choices"][0]["text"])
            if first is None:
                first = time.monotonic()
                if on_first_chunk is not None:
                    on_first_chunk()
    return "".join(text), errors, time.monotonic() - (first or time.monotonic())


def test_smollm2_three_processes_tp3_serve_then_lose_a_worker(tmp_path, smollm2_dir):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    reference, _ = _generate(tmp_path, smollm2_dir, "smollm2_tp1", prompts=[
        {"id": i, "prompt": p} for i, p in enumerate(prompts)], flags=["--max_model_len=160", "--ignore_eos"])
    expected_texts = dict(_generate.texts)
    port = free_port()
    job = Job(tmp_path, "serve", 3, 1, [f"--model={smollm2_dir}", f"--port={port}", "--tensor_parallel_size=3",
                                        *SERVE_FLAGS])
    url = f"http://127.0.0.1:{port}"
    try:
        health = _wait_healthy(url, job)
        assert health["num_processes"] == 3 and health["multihost_failure"] is None
        for i, prompt in enumerate(prompts):  # greedy: the same tokens as one process at TP 1
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            response = requests.post(url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            expected = expected_texts[i]
            assert response.json()["choices"][0]["text"] == expected
            streamed, errors, _ = _stream(url, body)
            assert streamed == expected and not errors
        for i in range(3):  # each process holds only its third of the weights
            local, total, rss_before, rss_after = _weights_line(job.log(i))
            assert abs(local - total / 3) < 0.01 * total
            # RSS grows by that third (the CPU devices' memory is the process's) and by what the
            # restore has not handed back yet: it decompresses each dense array whole (one chunk)
            # before taking its slice, with a varying number of them in flight, so the growth was
            # 1.3x to 1.9x the third over runs; a process keeping all the weights would grow by `total`.
            assert rss_after - rss_before < 0.85 * total, (rss_before, rss_after, total)

        # Kill worker 2 in the middle of a stream: the client gets an error naming it within the bound.
        body = {"model": "smollm2", "prompt": prompts[0], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        killed = threading.Event()

        def kill_worker():
            job.procs[2].send_signal(signal.SIGKILL)
            killed.set()
        text, errors, seconds = _stream(url, body, on_first_chunk=kill_worker)
        assert killed.is_set() and errors, (text, errors)
        assert "process 2" in errors[0]["message"], errors
        assert seconds < LOST_PROCESS_BOUND_S, seconds
        response = requests.get(url + "/health", timeout=5)
        assert response.status_code == 503, response.text
        response = requests.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert response.status_code >= 500 and "process 2" in response.text, response.text
        # SIGTERM on process 0 ends the failed job; the remaining worker exits on its own, loudly.
        job.procs[0].send_signal(signal.SIGTERM)
        codes = job.wait(60)
        assert codes[0] == 1 and codes[1] != 0, codes
        assert "lost process 2 of 3" in job.log(0)
        # worker 1 saw the loss first-hand (its collective with process 2 broke), or lost process 0 after it
        assert re.search(r"process 1: (a step failed|lost the coordinator|lost process 0)", job.log(1)), \
            job.log(1)[-2000:]
        print(f"\nweights per process (MiB local / total, RSS before -> after): "
              f"{[_weights_line(job.log(i)) for i in range(3)]}; stream ended {seconds:.1f}s after the kill")
    finally:
        job.kill()


def test_sigterm_on_process_0_drains_and_stops_the_workers(tmp_path, tiny8):
    port = free_port()
    flags = [f for f in SERVE_FLAGS if not f.startswith("--num_pages")]  # the pool the processes agree on
    job = Job(tmp_path, "serve", 2, 1, [f"--model={tiny8}", f"--port={port}", "--tensor_parallel_size=2", *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, job)
        body = {"model": "model", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        text, errors, _ = _stream(url, body)
        assert text and not errors
        job.procs[0].send_signal(signal.SIGTERM)
        assert job.wait(60) == [0, 0]
        front, worker = job.log(0), job.log(1)
        assert re.search(r"process 0: \d+ steps sent to 2 processes .* 0 compilations after warm-up", front), front
        assert re.search(r"process 1: stop after \d+ steps followed, 0 compilations after warm-up", worker), worker
    finally:
        job.kill()
