"""Images through the engine (issue 53): tiny random Qwen2.5-VL and Gemma 3 models (tests/tiny_vlms.py,
random projector, so an image changes the answer) against transformers' generate on the same
processor inputs.

- greedy tokens equal transformers' with one and two images, the two images swapped (a different
  answer), and text-only requests in the same steps, under a token budget that splits the prompts
  into several chunks (a chunk is cut before an image rather than inside it);
- the first token's logprobs equal transformers' log-softmax; for Gemma 3 they differ from a causal
  image span's (transformers without token_type_ids), so the bidirectional spans are exercised;
- the encoder cache: a repeated image is not encoded again; the prefix cache keys pages by image:
  the same text with another image shares no page from the image on, and answers as a fresh engine;
- warm-up compiles the encoder's shapes; what cannot be served is refused at admission.
"""
import dataclasses

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.request import InvalidRequestError, SamplingParams
from jaxserve.engine import Engine
from jaxserve.core.engine_client import ImageService
from serve.prompts import chat_text, encode_chat, encode_image_prompt
from tests import tiny_vlms
from tests.tiny_vlms import convert_vlm, hf_processor, make_vlm, random_image

pytestmark = pytest.mark.slow  # builds torch models, converts them

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=24, max_num_prefill_seqs=4, max_model_len=256, page_size=8,
              num_pages=96, warmup=False)
IMAGES = {"a": (1, 112, 84), "b": (2, 56, 56), "c": (3, 84, 112)}  # seed, width, height


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def vlm(request, tmp_path_factory):
    """(family, torch model, converted directory, transformers' processor)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = make_vlm(family, str(root / "hf"))
    convert_vlm(str(root / "hf"), str(root / "converted"))
    return family, model, str(root / "converted"), hf_processor(family, str(root / "hf"))


def messages(text: str, images: str, text_first: bool = False) -> list[dict]:
    parts = [{"type": "image"} for _ in images]
    parts = [{"type": "text", "text": text}] + parts if text_first else parts + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def hf_generate(vlm, text: str, images: str, causal_images: bool = False):
    """transformers' greedy tokens and first-token log-softmax for the prompt; its input ids."""
    _, model, _, processor = vlm
    return tiny_vlms.hf_generate(model, processor, messages(text, images), [random_image(*IMAGES[i]) for i in images],
                                 MAX_TOKENS, causal_images)


def our_prompt(engine, text: str, images: str, text_first: bool = False):
    """(prompt ids, MultimodalInputs or None) as the server builds them (serve.prompts)."""
    chat = messages(text, images, text_first)
    if not images:
        return encode_chat(engine.tokenizer, chat), None
    processed = [engine.image_processor.process(random_image(*IMAGES[i])) for i in images]
    return encode_image_prompt(engine.tokenizer, chat_text(engine.tokenizer, chat), processed,
                               ImageService.of(engine))


def make_engine(vlm, **overrides) -> Engine:
    return Engine.from_model(vlm[2], EngineConfig(**{**ENGINE, **overrides}))


CASES = [("Describe the picture.", "a"), ("What differs between these two?", "ab"),
         ("What differs between these two?", "ba"), ("Say something about pictures in general.", "")]


def test_greedy_output_equals_transformers_with_images_and_text_in_the_same_steps(vlm):
    engine = make_engine(vlm)
    prompts = [our_prompt(engine, text, images) for text, images in CASES]
    results = engine.generate([ids for ids, _ in prompts], GREEDY, multimodal=[mm for _, mm in prompts])
    outputs = {}
    for (text, images), (ids, mm), result in zip(CASES, prompts, results):
        expected, _, hf_ids = hf_generate(vlm, text, images)
        assert ids == hf_ids, f"{vlm[0]} {images!r}: prompt ids differ from the processor's"
        assert result.token_ids == expected, f"{vlm[0]} {images!r}"
        outputs[images] = result.token_ids
    assert outputs["ab"] != outputs["ba"], "the images' order should change the answer"
    assert outputs["a"] != outputs[""]
    # the budget of 24 tokens split the image prompts (> 40 tokens) into chunks, each image whole
    assert max(len(ids) for ids, _ in prompts) > ENGINE["max_num_batched_tokens"]
    assert engine.scheduler.encoder_cache.num_encoded == 2  # "a" and "b" once each


def test_first_token_logprobs_equal_transformers(vlm):
    engine = make_engine(vlm, max_logprobs=5)
    ids, mm = our_prompt(engine, "What differs between these two?", "ab")
    result = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), multimodal=[mm])[0]
    _, reference, _ = hf_generate(vlm, "What differs between these two?", "ab")
    ours = {token: logprob for token, logprob in result.logprobs[0].top}
    np.testing.assert_allclose([ours[t] for t in ours], [reference[t] for t in ours], atol=2e-4)
    if vlm[0] == "gemma":  # an image's tokens see the whole image: a causal span gives other logits
        _, causal, _ = hf_generate(vlm, "What differs between these two?", "ab", causal_images=True)
        assert max(abs(ours[t] - causal[t]) for t in ours) > 1e-3


def test_encoder_cache_and_prefix_cache_key_the_image(vlm):
    engine = make_engine(vlm, max_num_batched_tokens=256)
    cache = engine.scheduler.encoder_cache
    first, mm_first = our_prompt(engine, "Describe the picture.", "a")
    engine.generate([first], GREEDY, multimodal=[mm_first])
    assert cache.num_encoded == 1
    # the same image after a text: no page in common from the text on, the embeddings reused
    other, mm_other = our_prompt(engine, "Now a different question about it, please.", "a", text_first=True)
    engine.generate([other], GREEDY, multimodal=[mm_other])
    assert (cache.num_encoded, cache.num_hits) == (1, 1)
    # the same text with another image: pages shared only before that image
    swapped, mm_swapped = our_prompt(engine, "Describe the picture.", "c")
    result = engine.generate([swapped], GREEDY, multimodal=[mm_swapped])[0]
    assert result.num_cached_tokens <= mm_swapped.images[0].offset
    fresh = make_engine(vlm, max_num_batched_tokens=256).generate([swapped], GREEDY, multimodal=[mm_swapped])[0]
    assert result.token_ids == fresh.token_ids
    # the first prompt again: its pages come from the prefix cache, image included
    again = engine.generate([first], GREEDY, multimodal=[mm_first])[0]
    assert again.num_cached_tokens >= mm_first.images[0].end


def test_warmup_compiles_the_encoder_shapes(vlm):
    engine = make_engine(vlm, warmup=True, background_warmup=False)
    runner = engine.runner
    assert sorted(runner.executables.keys("encoder")) == sorted(runner.encoder_shapes())
    ids, mm = our_prompt(engine, "Describe the picture.", "a")
    assert engine.generate([ids], GREEDY, multimodal=[mm])[0].token_ids == hf_generate(vlm, "Describe the picture.", "a")[0]


def test_admission_refuses_what_cannot_be_computed(vlm):
    engine = make_engine(vlm, max_num_batched_tokens=40, max_num_seqs=38)  # an image may take 40 - 37 tokens
    ids, mm = our_prompt(engine, "Describe the picture.", "a")
    with pytest.raises(InvalidRequestError, match="more than one step can compute"):
        engine.make_request("big", ids, GREEDY, mm)
    moved = list(ids)
    moved[mm.images[0].offset - 1], moved[mm.images[0].end - 1] = moved[mm.images[0].end - 1], moved[mm.images[0].offset - 1]
    with pytest.raises(InvalidRequestError, match="tokens are not where"):
        make_engine(vlm).make_request("moved", moved, GREEDY, mm)
    with pytest.raises(ValueError, match="not supported with a vision-language model"):
        make_engine(vlm, speculative_method="ngram", num_speculative_tokens=2)


def test_the_plan_counts_what_the_engine_holds_for_images(vlm):
    """`plan`'s vision lines are the engine's own bytes: the tower's params and the pool."""
    from jaxserve.planning import memory
    from jaxserve.models import quantization
    engine = make_engine(vlm)
    cfg = EngineConfig(**ENGINE)
    plan = memory.plan_engine(engine.model_config, cfg, device_memory_bytes=8 << 30, on_gpu=False)
    vision = engine.runner.vision
    assert plan.vision_weights_bytes == quantization.tree_bytes(vision.params)
    assert plan.image_pool_bytes == vision.pool.nbytes
    assert plan.vision_activation_bytes > 0
    text_only = memory.plan_engine(dataclasses.replace(engine.model_config, multimodal_architecture=None), cfg,
                                   device_memory_bytes=8 << 30, on_gpu=False)
    assert text_only.vision_weights_bytes == 0


def test_an_image_larger_than_the_prefill_threshold_passes_it_beside_decoding_rows(vlm):
    """`serve` on the CPU bounds the prefill tokens beside decoding rows (long_prefill_token_threshold);
    a chunk that starts an image larger than that bound takes the whole image in one step anyway."""
    engine = make_engine(vlm, long_prefill_token_threshold=2, max_num_batched_tokens=40)
    text_ids, _ = our_prompt(engine, "Say something about pictures in general.", "")
    text = engine.add_request("text", text_ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while not text.output_token_ids:  # the text request decodes from now on
        engine.step()
    ids, mm = our_prompt(engine, "Describe the picture.", "a")
    assert mm.images[0].num_tokens > 2
    engine.add_request("image", ids, GREEDY, mm)
    tokens, image_steps = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "image":
                tokens += out.new_token_ids
        record = engine.step_records[-1]
        image_steps.append((record.num_decode_rows, record.num_prefill_tokens))
    assert tokens == hf_generate(vlm, "Describe the picture.", "a")[0]
    assert any(rows and prefill > 2 for rows, prefill in image_steps)  # the image beside a decoding row
