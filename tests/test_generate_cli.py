"""`jaxserve generate`: JSONL in/out, resumable, and clear errors with exit code 2."""
import json

import pytest

from jaxserve.commands import cli

pytestmark = pytest.mark.slow  # jaxserve generate end to end: out of `make test-quick`

ENGINE_FLAGS = ["--max_num_seqs=4", "--max_num_batched_tokens=64", "--num_pages=64", "--page_size=8",
                "--max_model_len=128", "--noprogress"]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def generate(model_dir, inp, out, *extra):
    return cli.main(["jaxserve", "generate", f"--model={model_dir}", f"--input={inp}", f"--output={out}",
                     *ENGINE_FLAGS, *extra])


def test_generates_resumes_and_skips_done_ids(tiny_chat_model_dir, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": 1, "prompt": "The quick brown fox"}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ])
    out = tmp_path / "out.jsonl"
    assert generate(tiny_chat_model_dir, inp, out, "--max_tokens=5", "--ignore_eos") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and {r["id"] for r in rows} == {1, "chat"}
    by_id = {r["id"]: r for r in rows}
    assert by_id[1]["num_output_tokens"] == 5 and by_id["chat"]["num_output_tokens"] == 3
    assert set(by_id[1]) == {"id", "text", "token_ids", "finish_reason", "num_prompt_tokens", "num_output_tokens"}
    assert by_id["chat"]["num_prompt_tokens"] > by_id[1]["num_prompt_tokens"]  # chat template applied
    assert "output tokens/s" in capsys.readouterr().err

    # Resume: a new id is generated, the done ones are skipped (same greedy output as before).
    write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": 1, "prompt": "The quick brown fox"}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        json.dumps({"id": 2, "prompt": "The quick brown fox"}),
    ])
    assert generate(tiny_chat_model_dir, inp, out, "--max_tokens=5", "--ignore_eos") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows].count(1) == 1 and len(rows) == 3
    assert {r["id"]: r for r in rows}[2]["token_ids"] == by_id[1]["token_ids"]


@pytest.mark.parametrize("lines,message", [
    (['{"id": 1, "prompt": "ok"}', '{"id": 2, "prompt": '], "in.jsonl:2: not valid JSON"),
    (['["not", "an", "object"]'], "must be a JSON object"),
    (['{"prompt": "no id"}'], "'id'"),
    (['{"id": 1, "prompt": 5}'], "'prompt' must be a string"),
    (['{"id": 1, "messages": "hi"}'], "'messages' must be a non-empty list"),
    (['{"id": 1, "prompt": "a", "messages": []}'], "exactly one of"),
    (['{"id": 1, "prompt": "a", "max_tokens": "ten"}'], "'max_tokens' has the wrong type"),
    (['{"id": 1, "prompt": "a", "temperature": -1}'], "temperature"),
    (['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}'], "duplicate id"),
])
def test_bad_input_lines_exit_2_with_the_line(tmp_path, capsys, lines, message):
    inp = write_lines(tmp_path / "in.jsonl", lines)
    assert generate("unused-model", inp, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_files_and_models_exit_2(tiny_chat_model_dir, tmp_path, capsys):
    assert generate(tiny_chat_model_dir, tmp_path / "missing.jsonl", tmp_path / "out.jsonl") == 2
    assert "no such file" in capsys.readouterr().err
    inp = write_lines(tmp_path / "in.jsonl", ['{"id": 1, "prompt": "a"}'])
    assert generate(str(tmp_path / "no-model"), inp, tmp_path / "out.jsonl") == 2
    assert "cannot load" in capsys.readouterr().err
    assert cli.main(["jaxserve", "generate", "--nonsense_flag=1"]) == 2
    assert cli.main(["jaxserve", "nonsense"]) == 2


def test_prompt_too_long_is_refused_before_running(tiny_chat_model_dir, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": 1, "prompt": "word " * 300})])
    assert generate(tiny_chat_model_dir, inp, tmp_path / "out.jsonl") == 2
    assert "the prompt has 301 tokens, leaving no room for a completion" in capsys.readouterr().err


def test_saved_executables_load_and_a_mismatch_exits_2(tiny_chat_model_dir, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": 1, "prompt": "The quick brown fox"})])
    folder = tmp_path / "executables"
    # A 32-token budget (the prompt's 5 tokens fit): one prefill bucket, so 5 step shapes to
    # compile and save, not 7; the loading run passes the same flags.
    small = "--max_num_batched_tokens=32"
    assert generate(tiny_chat_model_dir, inp, tmp_path / "a.jsonl", "--max_tokens=4", "--ignore_eos", small,
                    f"--save_executables={folder}") == 0
    assert (folder / "manifest.json").exists()
    # Loaded in a new process: nothing traced there registers the C++ kernels the decode step calls.
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", "import sys; from jaxserve.commands import cli; sys.exit(cli.main(sys.argv))",
                           "generate", f"--model={tiny_chat_model_dir}", f"--input={inp}",
                           f"--output={tmp_path / 'b.jsonl'}", *ENGINE_FLAGS, "--max_tokens=4", "--ignore_eos", small,
                           f"--executables={folder}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "could not load" not in proc.stderr, proc.stderr[-3000:]  # (a failed load would compile instead)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    capsys.readouterr()
    assert generate(tiny_chat_model_dir, inp, tmp_path / "c.jsonl", small, f"--executables={folder}",
                    "--max_num_seqs=2") == 2
    err = capsys.readouterr().err
    assert "saved for another engine (buckets: saved" in err and "Traceback" not in err


@pytest.mark.parametrize("flags_given, max_num_seqs", [
    ([], 64),  # a batch job's own default on the CPU (a server's is 32)
    (["--max_num_seqs=16"], 16),
    (["--max_num_batched_tokens=48"], 48),  # within the step's token budget
    (["--decode_buckets=8,32"], 32),  # explicit buckets end at --max_num_seqs: its default kept
])
def test_generate_decodes_64_sequences_at_once_on_the_cpu_unless_told(tmp_path, monkeypatch, capsys, flags_given,
                                                                       max_num_seqs):
    from jaxserve.commands import generate as generate_command
    built = []

    def from_model(model, config):
        built.append(config)
        raise ValueError("not loaded in this test")
    monkeypatch.setattr(generate_command.Engine, "from_model", from_model)
    inp = write_lines(tmp_path / "in.jsonl", ['{"id": 1, "prompt": "a"}'])
    assert cli.main(["jaxserve", "generate", "--model=unused", f"--input={inp}", f"--output={tmp_path / 'out.jsonl'}",
                     *flags_given]) == 2
    assert "not loaded in this test" in capsys.readouterr().err
    assert built[0].max_num_seqs == max_num_seqs
