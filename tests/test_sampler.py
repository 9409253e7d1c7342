"""Tests of the batched sampler against numpy references of the vLLM semantics."""

import functools

import jax
import numpy as np
import pytest

from jaxserve.core.request import SamplingParams
from jaxserve.executor.sampler import (NUM_CANDIDATES, RowInputError, RowParams, allowed_tokens, apply_penalties, bias_entries,
                              bias_width, build_sampling_inputs, has_bias, has_histories, row_key_data, sample)

VOCAB = 1000  # not a multiple of any block size: exercises the -inf padding
NUM_ROWS = 64
HISTORY = 16
MAX_LOGPROBS = 5

_sample = jax.jit(functools.partial(sample, max_logprobs=MAX_LOGPROBS))
_allowed = jax.jit(allowed_tokens)
_penalties = jax.jit(apply_penalties)


def make_row(seed=0, step=0, prompt_token_ids=(), output_token_ids=(), num_logprobs=None, **sampling):
    """A RowParams from SamplingParams fields (and num_logprobs) plus the row's stream and history."""
    return RowParams(SamplingParams(logprobs=num_logprobs, **sampling), seed=seed, step=step,
                     prompt_token_ids=list(prompt_token_ids), output_token_ids=list(output_token_ids))


def run(logits, rows, num_rows=NUM_ROWS):
    inputs = build_sampling_inputs(rows, num_rows, HISTORY)
    padded = np.zeros((num_rows, logits.shape[1]), np.float32)
    padded[:len(logits)] = logits
    return {name: np.asarray(value) for name, value in _sample(padded, inputs).items()}


def random_logits(rng, num_rows, scale):
    return (rng.standard_normal((num_rows, VOCAB)) * scale).astype(np.float32)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_penalties(logits, row):
    logits = np.asarray(logits, np.float64).copy()
    counts = np.bincount(row.output_token_ids, minlength=len(logits))
    seen = counts > 0
    seen[row.prompt_token_ids] = True
    penalty = row.params.repetition_penalty
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
    return logits - row.params.frequency_penalty * counts - row.params.presence_penalty * (counts > 0)


def reference_allowed(logits, row, top_p_shift=0.0, min_p_shift=0.0):
    """Kept set of one sampling row, by sorting (float64); shifts probe the boundaries."""
    params = row.params
    scaled = reference_penalties(logits, row) / params.temperature
    keep = np.ones(len(scaled), bool)
    if 0 < params.top_k < len(scaled):
        keep &= scaled >= np.sort(scaled)[::-1][params.top_k - 1]
    top_p = params.top_p + top_p_shift
    if params.top_p < 1.0:
        probs = np.exp(log_softmax(np.where(keep, scaled, -np.inf)))
        descending = np.sort(probs)[::-1]
        mass_before = np.cumsum(descending) - descending
        last = max(int(np.sum(mass_before < top_p)) - 1, 0)
        keep &= probs >= descending[last]
    if params.min_p > 0:
        probs = np.exp(log_softmax(scaled))
        keep &= probs >= (params.min_p + min_p_shift) * probs.max()
    return keep


def assert_allowed_matches(logits, rows):
    got = np.asarray(_allowed(logits, build_sampling_inputs(rows, len(rows), HISTORY)))
    for index, row in enumerate(rows):
        if row.params.temperature == 0.0:
            continue  # greedy rows take the argmax; their mask means nothing
        inner = reference_allowed(logits[index], row, top_p_shift=-1e-5, min_p_shift=1e-5)
        outer = reference_allowed(logits[index], row, top_p_shift=1e-5, min_p_shift=-1e-5)
        assert np.all(got[index] >= inner) and np.all(got[index] <= outer), (index, row)
    return got


def test_greedy_is_first_argmax_of_penalized_logits():
    rng = np.random.default_rng(0)
    logits = random_logits(rng, NUM_ROWS, 3.0)
    logits[1, [3, 700]] = logits[1].max() + 1.0  # ties: the first index wins
    logits[4, [9, 12]] = logits[4].max() + 1.0
    rows = [make_row(temperature=0.0, top_k=5, top_p=0.5) for _ in range(NUM_ROWS)]
    out = run(logits, rows)
    np.testing.assert_array_equal(out["token_ids"], np.argmax(logits, -1))
    assert out["token_ids"][1] == 3 and out["token_ids"][4] == 9

    best = int(np.argmax(logits[2]))
    rows[2] = make_row(temperature=0.0, repetition_penalty=50.0, presence_penalty=20.0,
                        output_token_ids=[best])
    penalized_choice = run(logits, rows)["token_ids"][2]
    assert penalized_choice == np.argmax(reference_penalties(logits[2], rows[2])) != best


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(1)
    logits = random_logits(rng, 6, 2.0)
    rows = [make_row(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.7,
                      prompt_token_ids=[1, 2, 3, 999], output_token_ids=[3, 3, 5, 5, 5, 0]),
            make_row(repetition_penalty=0.8, prompt_token_ids=list(range(10, 26))),
            make_row(frequency_penalty=-0.5, output_token_ids=[7] * HISTORY),
            make_row(presence_penalty=2.0, output_token_ids=[998, 4]),
            make_row(),
            None]
    inputs = build_sampling_inputs(rows, len(rows), HISTORY)
    got = np.asarray(_penalties(logits, inputs))
    for index, row in enumerate(rows[:-1]):
        np.testing.assert_allclose(got[index], reference_penalties(logits[index], row), rtol=1e-6)
    np.testing.assert_array_equal(got[4:], logits[4:])


def test_allowed_set_matches_sorting_reference():
    rng = np.random.default_rng(2)
    cases = [dict(top_k=5), dict(top_k=NUM_CANDIDATES), dict(top_k=NUM_CANDIDATES + 1),
             dict(top_k=400), dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.99),
             dict(min_p=0.2), dict(top_k=300, top_p=0.8), dict(top_k=20, top_p=0.7, min_p=0.1),
             dict(top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5,
                  prompt_token_ids=list(range(8)), output_token_ids=[0, 0, 9])]
    rows, logit_rows = [], []
    for case in cases:
        for scale in (0.05, 1.0, 6.0):  # flat rows need the exact bisection, peaked ones not
            rows.append(make_row(temperature=float(rng.uniform(0.5, 1.5)), **case))
            logit_rows.append(random_logits(rng, 1, scale)[0])
    got = assert_allowed_matches(np.stack(logit_rows), rows)
    sizes = got.sum(-1)
    assert sizes.min() >= 1 and sizes.max() > NUM_CANDIDATES  # both code paths were exercised


def test_tiny_vocab_without_logprobs():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((4, 40)) * 2).astype(np.float32)
    rows = [make_row(top_k=30, top_p=0.8, seed=1), make_row(min_p=0.1, seed=2),
            make_row(temperature=0.0), make_row(top_p=0.3, seed=3)]
    assert_allowed_matches(logits, rows)
    out = jax.jit(functools.partial(sample, max_logprobs=0))(
        logits, build_sampling_inputs(rows, 4, HISTORY))
    assert out["top_ids"].shape == (4, 0) and out["top_logprobs"].shape == (4, 0)
    assert int(out["token_ids"][2]) == int(np.argmax(logits[2]))


def test_ties_at_the_cut_are_kept():
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, :10] = [5, 4, 3, 3, 3, 3, 2, 1, 1, 0]
    inputs = build_sampling_inputs([make_row(top_k=3)], 1, HISTORY)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(_allowed(logits, inputs))[0]),
                                  [0, 1, 2, 3, 4, 5])


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.6), dict(top_p=0.9),
                                    dict(min_p=0.3), dict(top_k=200, top_p=0.97, min_p=0.01)])
def test_draws_stay_inside_the_allowed_set(params):
    rng = np.random.default_rng(3)
    logits = np.repeat(random_logits(rng, 1, 1.5), NUM_ROWS, 0)
    row = make_row(temperature=1.0, **params)
    outer = reference_allowed(logits[0], row, top_p_shift=1e-5, min_p_shift=-1e-5)
    drawn = np.concatenate([
        run(logits, [make_row(temperature=1.0, seed=seed, step=step, **params)
                     for seed in range(NUM_ROWS)])["token_ids"] for step in range(8)])
    assert outer[drawn].all()
    assert len(set(drawn.tolist())) > 1


def test_draw_frequencies_follow_the_distribution():
    logits = np.full((NUM_ROWS, VOCAB), -40.0, np.float32)
    tokens = np.array([3, 255, 256, 511, 700, 999])  # spread across sampling blocks
    logits[:, tokens] = [1.0, 0.2, 0.0, -0.5, 0.7, -1.0]
    num_steps = 40
    for temperature in (1.0, 2.0):
        drawn = np.concatenate([
            run(logits, [make_row(temperature=temperature, seed=seed, step=step)
                         for seed in range(NUM_ROWS)])["token_ids"] for step in range(num_steps)])
        assert np.isin(drawn, tokens).all()
        expected = np.exp(log_softmax(logits[0, tokens] / temperature))
        frequency = np.array([(drawn == token).mean() for token in tokens])
        tolerance = 4 * np.sqrt(expected * (1 - expected) / len(drawn)) + 1e-3
        assert np.all(np.abs(frequency - expected) < tolerance), (frequency, expected)


def test_seeded_draws_ignore_batch_position_and_companions():
    rng = np.random.default_rng(4)
    own_logits = random_logits(rng, 1, 1.0)[0]
    others = random_logits(rng, 16, 0.05)

    def own(step):
        return make_row(temperature=0.9, top_p=0.95, min_p=0.01, seed=1234, step=step)

    def companions(step):  # greedy, penalties, exact-search rows and padding
        return [make_row(temperature=1.0, top_k=500, seed=7, step=step),
                make_row(temperature=0.0),
                make_row(temperature=1.3, top_p=0.99, seed=step,
                          repetition_penalty=1.2, output_token_ids=[1, 2]),
                None]

    for step in range(6):
        alone = run(own_logits[None], [own(step)], num_rows=8)["token_ids"][0]
        logits = others.copy()
        logits[5] = own_logits
        rows = companions(step) + [None, own(step)]
        mixed = run(logits, rows)["token_ids"][5]
        assert alone == mixed


def test_different_seeds_and_steps_draw_differently():
    logits = np.zeros((NUM_ROWS, VOCAB), np.float32)
    by_seed = run(logits, [make_row(seed=seed) for seed in range(NUM_ROWS)])["token_ids"]
    by_step = [run(logits, [make_row(seed=5, step=step)])["token_ids"][0] for step in range(10)]
    repeated = run(logits, [make_row(seed=seed) for seed in range(NUM_ROWS)])["token_ids"]
    assert len(set(by_seed.tolist())) > NUM_ROWS // 2
    assert len(set(by_step)) > 5
    np.testing.assert_array_equal(by_seed, repeated)


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(5)
    logits = random_logits(rng, NUM_ROWS, 2.0)
    rows = [make_row(temperature=0.7, top_k=10, repetition_penalty=1.5,
                      output_token_ids=[1, 2, 3], seed=i, num_logprobs=2) for i in range(NUM_ROWS)]
    out = run(logits, rows)
    expected = log_softmax(logits)
    np.testing.assert_allclose(
        out["logprobs"], np.take_along_axis(expected, out["token_ids"][:, None], 1)[:, 0], atol=1e-5)
    top = np.argsort(-logits, -1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out["top_ids"], top)
    np.testing.assert_allclose(out["top_logprobs"], np.take_along_axis(expected, top, 1), atol=1e-5)


def test_padding_rows_stay_finite():
    rng = np.random.default_rng(6)
    logits = random_logits(rng, 2, 1.0)
    rows = [make_row(temperature=1.0, top_p=0.9, num_logprobs=3), None, None]
    out = run(logits, rows)
    for name in ("logprobs", "top_logprobs"):
        assert np.isfinite(out[name]).all()
    assert ((out["token_ids"] >= 0) & (out["token_ids"] < VOCAB)).all()


def test_builder_shapes_history_and_keys():
    rows = [make_row(seed=3, step=2, prompt_token_ids=[1, 2], output_token_ids=[9]),
            make_row(seed=3, step=2, presence_penalty=0.5, prompt_token_ids=[1, 2],
                      output_token_ids=[9], top_k=-1, num_logprobs=0),
            None]
    inputs = build_sampling_inputs(rows, 4, 5)
    assert all(value.shape[0] == 4 for value in inputs.values())
    assert inputs["prompt_ids"].shape == (4, 5) and inputs["prompt_ids"].dtype == np.int32
    assert inputs["keys"].dtype == np.uint32
    np.testing.assert_array_equal(inputs["prompt_ids"][0], [-1] * 5)  # no penalty: not needed
    np.testing.assert_array_equal(inputs["prompt_ids"][1], [1, 2, -1, -1, -1])
    np.testing.assert_array_equal(inputs["output_ids"][1], [9, -1, -1, -1, -1])
    np.testing.assert_array_equal(inputs["num_logprobs"], [-1, 0, -1, -1])
    assert inputs["top_k"][1] == 0
    np.testing.assert_array_equal(inputs["keys"][0], inputs["keys"][1])
    assert row_key_data(3, 2) != row_key_data(3, 3) and row_key_data(3, 2) != row_key_data(4, 2)

    with pytest.raises(RowInputError, match="history_len") as info:
        build_sampling_inputs([None, make_row(frequency_penalty=1.0, output_token_ids=[1] * 6)], 2, 5)
    assert info.value.row_index == 1
    with pytest.raises(ValueError, match="num_rows"):
        build_sampling_inputs([None, None], 1, 5)
    # A value that does not fit its int32 array (admission refuses it) names its row, not the step.
    with pytest.raises(RowInputError, match="OverflowError") as info:
        build_sampling_inputs([make_row(), make_row(top_k=2**31)], 2, 5)
    assert info.value.row_index == 1


def test_histories_only_when_a_row_has_a_penalty():
    """A step without penalties neither builds nor transfers the [rows, history] arrays; the variant
    with them gives the same draws to rows without a penalty."""
    rng = np.random.default_rng(8)
    logits = random_logits(rng, 8, 1.0)
    plain = [make_row(temperature=t, top_p=0.9, seed=i, num_logprobs=2, output_token_ids=[1, 2])
             for i, t in enumerate([0.0, 0.8, 1.0, 1.2])] + [None]
    without = build_sampling_inputs(plain, 8, HISTORY)
    assert not has_histories(without) and "prompt_ids" not in without
    forced = build_sampling_inputs(plain, 8, HISTORY, penalties=True)
    assert has_histories(forced) and (forced["output_ids"] == -1).all()  # no row reads its history
    run_without, run_forced = (jax.tree.map(np.asarray, _sample(logits, inputs)) for inputs in (without, forced))
    for name in run_without:
        np.testing.assert_array_equal(run_without[name], run_forced[name], err_msg=name)

    penalized = plain[:4] + [make_row(temperature=0.0, presence_penalty=2.0, output_token_ids=[3])]
    assert has_histories(build_sampling_inputs(penalized, 8, HISTORY))
    with pytest.raises(ValueError, match="penalty"):
        build_sampling_inputs(penalized, 8, HISTORY, penalties=False)


EOS = (7, 11)


def build(rows, num_rows=8, **kwargs):
    return build_sampling_inputs(rows, num_rows, HISTORY, eos_token_ids=EOS, **kwargs)


def run_with_eos(logits, rows, num_rows=8):
    padded = np.zeros((num_rows, logits.shape[1]), np.float32)
    padded[:len(logits)] = logits
    return {name: np.asarray(value) for name, value in _sample(padded, build(rows, num_rows)).items()}


def test_bias_arrays_only_when_a_row_has_an_entry():
    """A step without logit biases or min_tokens masks neither builds nor transfers the bias arrays;
    the variant with them gives the same draws to rows without one."""
    rng = np.random.default_rng(9)
    logits = random_logits(rng, 8, 1.0)
    plain = [make_row(temperature=t, top_p=0.9, seed=i, num_logprobs=2) for i, t in enumerate([0.0, 0.8, 1.0, 1.2])]
    plain += [make_row(min_tokens=2, step=2, stop_token_ids=[5]), None]  # past its min_tokens: no entry
    without = build(plain)
    assert not has_bias(without) and "bias_values" not in without
    forced = build(plain, bias=True)
    assert forced["bias_ids"].shape == forced["bias_values"].shape == (8, bias_width(len(EOS)))
    assert (forced["bias_ids"] >= VOCAB).all() and forced["bias_ids"].dtype == np.int32  # all padding
    run_without, run_forced = (jax.tree.map(np.asarray, _sample(logits, inputs)) for inputs in (without, forced))
    for name in run_without:
        np.testing.assert_array_equal(run_without[name], run_forced[name], err_msg=name)

    biased = plain[:4] + [make_row(logit_bias={3: 1.5, 999: -2.0})]
    inputs = build(biased)
    assert has_bias(inputs) and not has_histories(inputs)
    np.testing.assert_array_equal(inputs["bias_ids"][4, :3], [3, 999, np.iinfo(np.int32).max])
    np.testing.assert_array_equal(inputs["bias_values"][4, :2], [1.5, -2.0])
    assert (inputs["bias_ids"][:4] >= VOCAB).all()
    with pytest.raises(ValueError, match="logit bias"):
        build(biased, bias=False)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    assert bias_entries(make_row(min_tokens=2, step=1, stop_token_ids=[5, 7]), EOS) == [
        (5, -np.inf), (7, -np.inf), (11, -np.inf)]
    assert bias_entries(make_row(min_tokens=2, step=1, stop_token_ids=[5], ignore_eos=True), EOS) == [(5, -np.inf)]
    assert bias_entries(make_row(min_tokens=2, step=2, stop_token_ids=[5]), EOS) == []
    assert bias_entries(make_row(min_tokens=2, step=0, logit_bias={5: 3.0}), EOS) == [(5, 3.0), (7, -np.inf),
                                                                                       (11, -np.inf)]
    assert bias_entries(make_row(), EOS) == []


def test_logit_bias_and_min_tokens_steer_the_draw():
    rng = np.random.default_rng(10)
    logits = random_logits(rng, 8, 1.0)
    logits[4:, EOS[0]] = logits[4:].max() + 5.0  # EOS is these rows' argmax
    top, low = np.argmax(logits, -1), np.argmin(logits, -1)
    rows = [make_row(temperature=0.0, logit_bias={int(low[0]): 100.0}, num_logprobs=0),  # forced
            make_row(temperature=0.0, logit_bias={int(top[1]): -100.0}),  # avoided
            make_row(temperature=0.0, min_tokens=3, step=2, stop_token_ids=[int(top[2])]),  # stop token masked
            make_row(temperature=0.0, min_tokens=3, step=3, stop_token_ids=[int(top[3])]),  # past min_tokens
            make_row(temperature=0.0, min_tokens=1, step=0),  # EOS masked
            make_row(temperature=0.0, min_tokens=1, step=0, ignore_eos=True),  # EOS is not a stop token then
            make_row(temperature=0.0),  # no entry, in a step with the bias arrays
            make_row(temperature=1.0, seed=4, logit_bias={int(low[7]): 100.0})]
    out = run_with_eos(logits, rows)
    second = [int(np.argsort(row)[-2]) for row in logits]
    assert list(out["token_ids"]) == [low[0], second[1], second[2], top[3], second[4], EOS[0], top[6], low[7]]
    # Logprobs stay the raw model's (before biases, as vLLM's default).
    np.testing.assert_allclose(out["logprobs"][0], log_softmax(logits[0])[low[0]], rtol=1e-5)


def test_sampling_never_draws_a_masked_token():
    rng = np.random.default_rng(11)
    logits = random_logits(rng, 1, 0.1)
    logits[0, list(EOS) + [5]] = 8.0  # nearly all the mass
    drawn = set()
    for seed in range(64):
        rows = [make_row(temperature=0.5, seed=seed, min_tokens=4, step=seed % 4, stop_token_ids=[5])]
        drawn.add(int(run_with_eos(logits, rows)["token_ids"][0]))
    assert drawn and not drawn & {5, *EOS}
    unmasked = {int(run_with_eos(logits, [make_row(temperature=0.5, seed=s)])["token_ids"][0]) for s in range(8)}
    assert unmasked <= {5, *EOS}  # without the mask these tokens win


def test_a_row_too_wide_for_the_bias_arrays_fails_alone():
    too_many = make_row(logit_bias={i: 1.0 for i in range(bias_width(len(EOS)) + 1)})
    with pytest.raises(RowInputError, match="bias_width") as info:
        build([make_row(), too_many])
    assert info.value.row_index == 1
