"""Every engine setting is checked once, when the flags are parsed: EngineConfig declares the bounds
and the rules between settings (jaxserve.config.EngineConfig.check), absl checks each flag's own
bounds as it parses, and `jaxserve serve|generate|plan` exit 2 naming the flag before anything
loads (here: a model path that does not exist, which the error never gets to name). Bucket lists
are parsed once, into EngineConfig's tuples; `generate`'s sampling flags are SamplingParams'."""
import dataclasses
import subprocess
import sys

import pytest
from absl import flags

from jaxserve.commands import cli, engine_flags
from jaxserve.commands import generate as generate_command
from jaxserve.config import EngineConfig
from jaxserve.core.request import SamplingParams
from jaxserve.settings import SettingError

COMMANDS = ["serve", "generate", "plan"]
MISSING_MODEL = "/nonexistent/model"

BAD_SETTINGS = [  # (argv, what the error says, naming the flag)
    (["--num_scheduler_steps=65"], "--num_scheduler_steps=65: 65 is not an integer in the range [1, 64]"),
    (["--num_scheduler_steps=0"], "--num_scheduler_steps=0"),
    (["--long_prefill_token_threshold=0"], "--long_prefill_token_threshold=0"),
    (["--num_pages=1"], "--num_pages=1"),
    (["--memory_utilization=0"], "--memory_utilization must be in (0, 1], got 0"),
    (["--max_num_seqs=64", "--max_num_batched_tokens=32"],
     "--max_num_batched_tokens (32) must be >= max_num_seqs (64)"),
    (["--quantize_embedding", "--tensor_parallel_size=2"], "--quantize_embedding needs the weights on one device"),
    (["--speculative_method=ngram", "--num_speculative_tokens=17"], "--num_speculative_tokens=17"),
    (["--speculative_method=ngram", "--prompt_lookup_min=6"],
     "--prompt_lookup_min (6) must be <= --prompt_lookup_max (5)"),
    (["--speculative_method=ngram", "--max_num_seqs=4", "--max_num_batched_tokens=4"],
     "--num_speculative_tokens + 1 (5) exceeds max_num_batched_tokens (4)"),
    (["--speculative_method=draft"], "--speculative_method=draft needs speculative_model"),
    (["--speculative_model=/some/draft"], "--speculative_model is only used with speculative_method=draft"),
    (["--speculative_method=draft", "--speculative_model=/some/draft", "--num_scheduler_steps=4"],
     "--num_scheduler_steps > 1 does not combine with speculative_method=draft"),
    (["--speculative_method=ngram", "--speculative_disable_by_batch_size=0"], "--speculative_disable_by_batch_size=0"),
    (["--decode_buckets=8,16", "--prefill_buckets=32,512"], "--decode_buckets='8,16': the largest size must be "
                                                            "--max_num_seqs=32"),
]


@pytest.mark.parametrize("argv, message", BAD_SETTINGS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_setting_that_cannot_work_exits_2_naming_its_flag_before_anything_loads(command, argv, message, capsys):
    assert cli.main(["jaxserve", command, f"--model={MISSING_MODEL}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxserve {command}: ") and message in err, err
    assert "Traceback" not in err and MISSING_MODEL not in err, err


def test_the_reported_case_fails_in_a_fraction_of_a_second_without_jax():
    """`serve --num_scheduler_steps=65` failed 17 s after the weights loaded: now at the flags,
    in a process that never imports jax."""
    script = ("import sys; from jaxserve.commands import cli; code = cli.main(sys.argv); "
              "print('jax loaded' if 'jax' in sys.modules else 'no jax'); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", script, "serve", "--model=smollm2", "--num_scheduler_steps=65"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--num_scheduler_steps=65" in proc.stderr and proc.stdout.strip() == "no jax", (proc.stdout, proc.stderr)


@pytest.mark.parametrize("change, message", [  # moved from test_speculative (its check is EngineConfig's now)
    (dict(speculative_method="medusa"), "speculative_method must be one of"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative_method="draft"), "needs speculative_model"),
    (dict(speculative_method="ngram", speculative_model="x"), "only used with speculative_method=draft"),
    (dict(speculative_method="ngram", num_speculative_tokens=8, max_num_batched_tokens=8), "max_num_batched_tokens"),
])
def test_bad_speculation_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**change)


def test_no_multi_step_with_a_draft_model():  # moved from test_multi_step
    with pytest.raises(ValueError, match="does not combine with speculative_method=draft"):
        EngineConfig(num_scheduler_steps=4, speculative_method="draft", speculative_model="m")


@pytest.mark.parametrize("kwargs", [  # moved from test_memory's test_nonsense_input: refused before the planner
    {"page_size": 0}, {"max_model_len": -1}, {"max_num_seqs": 0}, {"max_num_batched_tokens": 0},
    {"memory_utilization": 1.5}, {"memory_utilization": 0.0}, {"kv_cache_dtype": "float64"},
    {"tensor_parallel_size": 0}])
def test_nonsense_settings_are_refused_naming_the_flag(kwargs):
    with pytest.raises(SettingError, match=f"--{next(iter(kwargs))}"):
        EngineConfig(**kwargs)


def test_a_config_made_in_code_is_checked_as_the_flags_are():
    with pytest.raises(SettingError, match=r"--num_scheduler_steps must be in \[1, 64\], got 65"):
        EngineConfig(num_scheduler_steps=65)
    with pytest.raises(SettingError, match="--max_num_batched_tokens"):
        dataclasses.replace(EngineConfig(), max_num_batched_tokens=16)  # below max_num_seqs 32
    with pytest.raises(SettingError, match="unsupported kv_cache_dtype 'int4'"):
        EngineConfig(kv_cache_dtype="int4")


def _parsed(command, argv):
    fv = flags.FlagValues()
    command.define_flags(fv)
    fv(["jaxserve", *argv])
    return fv


def test_bucket_lists_are_parsed_once_into_tuples():
    config = engine_flags.engine_config(_parsed(generate_command, ["--max_num_seqs=16", "--decode_buckets=1, 4,16",
                                                                   "--prefill_buckets=64,512"]))
    assert config.decode_buckets == (1, 4, 16) and config.prefill_buckets == (64, 512)
    assert EngineConfig(decode_buckets=[8, 32]).decode_buckets == (8, 32)  # a sequence is taken too
    assert dataclasses.replace(config, warmup=False).decode_buckets == (1, 4, 16)  # a tuple stays one
    assert EngineConfig().decode_buckets is None and EngineConfig().prefill_buckets is None


def test_generate_sampling_flags_are_sampling_params_defaults_but_where_the_help_says_why():
    fv = _parsed(generate_command, [])
    given = engine_flags.sampling_kwargs(fv)
    api = SamplingParams()
    differ = {name for name, value in given.items() if getattr(api, name) != value}
    assert differ == {"max_tokens", "temperature"}
    assert (given["max_tokens"], given["temperature"]) == (128, 0.0)
    for name in differ:
        assert f"not the API's default of {getattr(api, name):g}" in fv[name].help
    assert SamplingParams(**given) == SamplingParams(max_tokens=128, temperature=0.0)


@pytest.mark.parametrize("argv, message", [
    (["--temperature=-1"], "flag --temperature=-1.0: temperature must be in [0, 2], got -1"),
    (["--top_p=0"], "flag --top_p=0.0: top_p must be in (0, 1]"),
    (["--max_tokens=0"], "flag --max_tokens=0: max_tokens must be >= 1"),
    (["--repetition_penalty=0"], "flag --repetition_penalty=0.0: repetition_penalty must be in [0.01, 100]"),
    (["--seed=-1"], "flag --seed=-1: seed must be in [0, "),
    (["--stop="], "stop strings must have 1 to 1024 characters"),
])
def test_bad_sampling_flags_exit_2_naming_the_flag(argv, message, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n')
    assert cli.main(["jaxserve", "generate", f"--model={MISSING_MODEL}", f"--input={inp}",
                     f"--output={tmp_path / 'out.jsonl'}", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and MISSING_MODEL not in err, err
