"""The host side of images in the engine (jaxserve.core.encoder_cache, jaxserve.multimodal.inputs):
the encoder cache's rows and eviction, how chunks are fitted around images, the per-token rows,
key limits and prefix-cache ids of a chunk, and the admission checks. No jax, no model."""
import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core import encoder_cache as ec
from jaxserve.core.request import InvalidRequestError, Request
from jaxserve.multimodal import inputs
from jaxserve.multimodal.admission import check_prompt_images


def image(tag: int, offset: int, num_tokens: int) -> inputs.ImageInput:
    pixels = np.full((2, 2), tag, np.float32)
    return inputs.ImageInput(inputs.content_hash(pixels, None), offset, num_tokens, pixels)


def prompt(*images, bidirectional=False) -> inputs.MultimodalInputs:
    return inputs.MultimodalInputs(tuple(images), bidirectional=bidirectional)


def test_reserve_evicts_the_least_recently_used_unpinned_entries():
    cache = ec.EncoderCache(num_rows=9)  # rows 1..8
    a, b, c = (bytes([i]) * 16 for i in range(3))
    rows_a, rows_b = cache.reserve(a, 4), cache.reserve(b, 4)
    assert sorted(rows_a + rows_b) == list(range(1, 9)) and cache.num_free_rows == 0
    cache.lookup(a)  # a is now the most recently used: b goes first
    rows_c = cache.reserve(c, 3)
    assert b not in cache and a in cache and set(rows_c) <= set(rows_b)
    cache.pin(a)
    cache.pin(c)
    assert cache.reserve(bytes([9]) * 16, 2) is None  # one row free, the rest pinned: nothing evicted
    assert a in cache and c in cache and cache.num_free_rows == 1
    cache.unpin_all()
    assert cache.reserve(bytes([9]) * 16, 2) is not None and a not in cache  # a was least recently used
    cache.clear()
    assert cache.num_free_rows == 8 and c not in cache
    with pytest.raises(ValueError):
        ec.EncoderCache(1)


def test_a_chunk_is_cut_before_an_image_it_would_end_inside():
    cache, mm = ec.EncoderCache(64), prompt(image(1, 5, 10), image(2, 20, 4))
    step = ec.StepImages(budget=100)
    assert ec.fit_chunk(mm, 0, 8, cache, step) == 5  # would end inside [5, 15): ends at 5
    assert not step.encode
    assert ec.fit_chunk(mm, 0, 15, cache, step) == 15  # the whole first image
    assert [job.image.offset for job in step.encode] == [5] and len(step.encode[0].rows) == 10
    assert ec.fit_chunk(mm, 15, 7, cache, step) == 5  # stops before the second image
    # a chunk starting inside a span (after a prefix-cache hit) must reach its end
    assert ec.fit_chunk(mm, 10, 3, cache, step) == 0
    assert ec.fit_chunk(mm, 10, 5, cache, step) == 5 and len(step.encode) == 1  # cached: no new job


def test_the_encoder_budget_and_the_pool_limit_a_steps_images():
    cache, mm = ec.EncoderCache(64), prompt(image(1, 2, 10), image(2, 12, 10), image(3, 30, 4))
    step = ec.StepImages(budget=15)
    assert ec.fit_chunk(mm, 0, 40, cache, step) == 12  # the second image is over the budget left
    assert step.budget == 5
    small = ec.EncoderCache(12)  # 11 rows: one image of 10, not two
    step = ec.StepImages(budget=100)
    assert ec.fit_chunk(mm, 0, 40, small, step) == 12
    small.unpin_all()
    step = ec.StepImages(budget=100)  # the next step: the first image is evicted for the second,
    assert ec.fit_chunk(mm, 12, 28, small, step) == 18  # which is pinned: no room for the third
    assert [job.image.offset for job in step.encode] == [12] and mm.images[0].content_hash not in small


def test_a_repeated_image_takes_the_same_rows_and_counts_a_hit():
    cache = ec.EncoderCache(64)
    same = prompt(image(7, 1, 3), image(7, 6, 3))
    step = ec.StepImages(budget=100)
    assert ec.fit_chunk(same, 0, 10, cache, step) == 10 and len(step.encode) == 1
    rows = ec.chunk_image_rows(same, 0, 10, step.rows)
    assert rows[1:4] == rows[6:9] and rows[0] == rows[4] == rows[5] == rows[9] == ec.NULL_ROW
    cache.unpin_all()
    step = ec.StepImages(budget=100)
    assert ec.fit_chunk(prompt(image(7, 0, 3)), 0, 3, cache, step) == 3 and not step.encode and cache.num_hits == 1


def test_rows_and_key_limits_of_a_chunk():
    mm = prompt(image(1, 2, 3), image(2, 7, 2), bidirectional=True)
    rows = {mm.images[0].content_hash: (11, 12, 13), mm.images[1].content_hash: (21, 22)}
    assert ec.chunk_image_rows(mm, 3, 9, rows) == (12, 13, 0, 0, 21, 22)
    assert ec.chunk_image_rows(mm, 10, 12, rows) is None
    assert ec.chunk_key_limits(mm, 0, 10) == (0, 1, 4, 4, 4, 5, 6, 8, 8, 9)
    assert ec.chunk_key_limits(mm, 9, 12) is None


def test_prefix_cache_ids_hold_the_image_hash_at_its_positions():
    a, b = image(1, 2, 3), image(2, 2, 3)
    request = Request("r", [5, 6, 9, 9, 9, 7, 8])
    plain = request.prefix_key_ids()
    request.multimodal = prompt(a)
    with_a = request.prefix_key_ids()
    request.multimodal = prompt(b)
    with_b = request.prefix_key_ids(4)
    assert plain == [5, 6, 9, 9, 9, 7, 8]
    assert with_a[:2] == [5, 6] and with_a[5:] == [7, 8] and len(set(with_a[2:5])) == 1 and with_a[2] < 0
    assert with_b == [5, 6, b.hash_value, b.hash_value] and b.hash_value != a.hash_value


def test_m_rope_positions_of_prompt_and_generated_tokens():
    mm = inputs.MultimodalInputs((), mrope_positions=np.array([[0, 1, 2], [0, 1, 5], [0, 1, 7]], np.int32),
                                 mrope_delta=5)
    assert inputs.text_positions(mm, 1, 5).tolist() == [[1, 2, 8, 9], [1, 5, 8, 9], [1, 7, 8, 9]]
    assert inputs.text_positions(None, 0, 3) is None


def test_image_spans_must_match_the_prompts_image_tokens():
    assert inputs.image_spans([1, 9, 9, 2, 9, 9, 9], 9, [2, 3]) == [1, 4]
    assert inputs.image_spans([1, 9, 9, 9, 9, 2], 9, [2, 2]) == [1, 3]  # adjacent images split by their counts
    with pytest.raises(ValueError, match="image tokens where"):
        inputs.image_spans([1, 9, 2], 9, [2])
    with pytest.raises(ValueError, match="consecutive"):
        inputs.image_spans([9, 1, 9], 9, [2])


def test_admission_of_images():
    text_model = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=8, num_layers=1, num_q_heads=1,
                             num_kv_heads=1, head_dim=8)
    with pytest.raises(InvalidRequestError, match="text model"):
        check_prompt_images([1, 2], prompt(image(1, 0, 1)), text_model, "tiny", 100)
    vlm = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=8, num_layers=1, num_q_heads=1, num_kv_heads=1,
                      head_dim=8, multimodal_architecture=inputs.GEMMA3_ARCHITECTURE, image_token_id=9)
    check_prompt_images([1, 9, 9, 2], prompt(image(1, 1, 2)), vlm, "tiny", 2)
    with pytest.raises(InvalidRequestError, match="more than one step"):
        check_prompt_images([1, 9, 9, 2], prompt(image(1, 1, 2)), vlm, "tiny", 1)
    with pytest.raises(InvalidRequestError, match="not where"):
        check_prompt_images([1, 9, 2, 9], prompt(image(1, 1, 2)), vlm, "tiny", 8)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    assert ec.max_image_tokens(config) == 57 and ec.pool_rows(config) == 129  # past the threshold: see the scheduler


@pytest.mark.parametrize("settings,flag", [
    (dict(tensor_parallel_size=2), "--tensor_parallel_size"), (dict(data_parallel_size=2), "--data_parallel_size"),
    (dict(speculative_method="ngram"), "--speculative_method"), (dict(num_scheduler_steps=4), "--num_scheduler_steps"),
    (dict(enable_lora=True), "--enable_lora"), (dict(runner="pooling"), "--runner=pooling")])
def test_settings_an_image_model_is_not_served_with_are_named(settings, flag):
    from jaxserve.multimodal.admission import check_vision_settings
    vlm = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=8, num_layers=1, num_q_heads=1, num_kv_heads=1,
                      head_dim=8, multimodal_architecture=inputs.GEMMA3_ARCHITECTURE, image_token_id=9)
    check_vision_settings(vlm, EngineConfig(), has_vision=True)
    with pytest.raises(ValueError, match=flag):
        check_vision_settings(vlm, EngineConfig(**settings), has_vision=True)
    with pytest.raises(ValueError, match="needs its vision tower"):
        check_vision_settings(vlm, EngineConfig(), has_vision=False)


def test_rows_reserved_for_a_step_that_does_not_run_are_not_kept():
    """A waiting request whose image got rows while the step was planned, but that was not admitted
    (no free KV pages): the step is empty and never runs, so the rows were never encoded and must
    not be found by a later request."""
    from jaxserve.core.page_allocator import PageAllocator
    from jaxserve.core.scheduler import Scheduler
    cache = ec.EncoderCache(64)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_num_prefill_seqs=4, page_size=4)
    scheduler = Scheduler(PageAllocator(3, 4), config, max_model_len=64, encoder_cache=cache)  # 2 usable pages
    request = Request("r", [1, 9, 9, 9, 9, 2, 3, 4, 5, 6])  # 10 tokens: 3 pages
    request.multimodal = prompt(image(1, 1, 4))
    scheduler.add_request(request)
    plan = scheduler.schedule()
    assert plan.is_empty and request.multimodal.images[0].content_hash not in cache and cache.num_free_rows == 63
