"""Time to first token of an image prompt: jaxserve vs transformers on the same model and inputs.

A random Qwen2.5-VL that is tiny in depth but wide (issue 53's benchmark): its vision tower at
Qwen2.5-VL's width (hidden 1280, 16 heads, MLP 3420; 2 blocks, one windowed, one full) and a
2-layer language model of hidden 2048 (16 heads, 2 KV heads, MLP 5632), SmolLM2's tokenizer
with the image tokens added (tests/tiny_vlms.py builds it once under --model_dir). One prompt:
a 448x448 image (256 image tokens) and about 100 text tokens, greedy, one output token.

Both sides start from the PIL image and the messages, in this process, in turns, each round
with a fresh image and text (no cache helps):
- transformers: its processor (PIL image processor), then one forward of
  Qwen2_5_VLForConditionalGeneration (float32, torch's threads);
- jaxserve: the engine's image processor, chat template and prompt expansion
  (serve.prompts.encode_image_prompt), then `Engine.generate(max_tokens=1)` (warmed up).
The encoder cache's effect: the same image again behind a new text (no page of the prefix cache
in common, the embeddings found), against a fresh image. The first tokens must agree.

  python bench/vlm_ttft.py --out bench/out/vlm_ttft.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

WIDE_VISION = dict(depth=2, hidden_size=1280, intermediate_size=3420, num_heads=16, fullatt_block_indexes=[1],
                   window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
PROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)  # Qwen2.5-VL's defaults
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def build(model_dir: str):
    """The wide model's folder and converted directory (made once); returns (torch model, converted path)."""
    import transformers
    from tests.tiny_vlms import convert_vlm, make_vlm
    hf, converted = os.path.join(model_dir, "hf"), os.path.join(model_dir, "converted")
    if not os.path.exists(os.path.join(converted, "jaxserve.json")):
        make_vlm("qwen", hf, hidden_size=2048, num_layers=2, intermediate_size=5632, num_heads=16,
                 qwen_vision=WIDE_VISION, qwen_processor=PROCESSOR)
        convert_vlm(hf, converted)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hf, dtype="float32").eval()
    return model, hf, converted


def text(rng, num_tokens: int, tokenizer) -> str:
    """Random words cut to `num_tokens` tokens."""
    words = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
    return tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[:num_tokens])


def messages(words: str, text_first: bool = False) -> list[dict]:
    parts = [{"type": "image"}, {"type": "text", "text": words}]
    return [{"role": "user", "content": parts[::-1] if text_first else parts}]


def run_transformers(model, processor, image, words: str) -> tuple[float, int, int]:
    """(seconds from the image to the first token, that token, prompt tokens)."""
    import torch
    start = time.perf_counter()
    prompt = processor.apply_chat_template(messages(words), add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    token = int(logits.argmax())
    return time.perf_counter() - start, token, inputs["input_ids"].shape[1]


def run_jaxserve(engine, image, words: str, text_first: bool = False) -> tuple[float, int, int]:
    from jaxserve.core.engine_client import ImageService
    from jaxserve.core.request import SamplingParams
    from serve.prompts import chat_text, encode_image_prompt
    start = time.perf_counter()
    processed = engine.image_processor.process(image)
    text = chat_text(engine.tokenizer, messages(words, text_first))
    ids, multimodal = encode_image_prompt(engine.tokenizer, text, [processed], ImageService.of(engine))
    result = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0), multimodal=[multimodal])[0]
    return time.perf_counter() - start, result.token_ids[0], len(ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", default=os.path.join(common.REPO_ROOT, "bench", "out", "vlm_wide"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--text_tokens", type=int, default=100)
    parser.add_argument("--image_size", type=int, default=448)
    parser.add_argument("--dtype", default="float32", help="jaxserve's --dtype (transformers runs float32)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import numpy as np
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine
    from tests.tiny_vlms import hf_processor, random_image
    info = common.machine_info(with_jax=True)
    model, hf, converted = build(args.model_dir)
    processor = hf_processor("qwen", hf)
    processor.image_processor.min_pixels, processor.image_processor.max_pixels = (PROCESSOR["min_pixels"],
                                                                                  PROCESSOR["max_pixels"])
    engine = Engine.from_model(converted, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024,
                                                       dtype=args.dtype, warmup=True))
    rng = np.random.default_rng(0)
    size = args.image_size
    run_jaxserve(engine, random_image(10_000, size, size), text(rng, args.text_tokens, engine.tokenizer))  # untimed
    run_transformers(model, processor, random_image(10_001, size, size), text(rng, args.text_tokens, engine.tokenizer))
    rows, agree = [], 0
    for round_index in range(args.rounds):
        image, words = random_image(round_index, size, size), text(rng, args.text_tokens, engine.tokenizer)
        turns = [("transformers", lambda: run_transformers(model, processor, image, words)),
                 ("jaxserve", lambda: run_jaxserve(engine, image, words))]
        if round_index % 2:
            turns.reverse()
        times = {}
        for name, run in turns:
            times[name] = run()
        agree += times["jaxserve"][1] == times["transformers"][1]
        # the same image again behind new text: the encoder cache's embeddings, no prefix page in common
        repeated = run_jaxserve(engine, image, text(rng, args.text_tokens, engine.tokenizer), text_first=True)
        fresh = run_jaxserve(engine, random_image(1000 + round_index, size, size),
                             text(rng, args.text_tokens, engine.tokenizer), text_first=True)
        rows.append({"round": round_index + 1, "prompt_tokens": times["jaxserve"][2],
                     "transformers_s": times["transformers"][0], "jaxserve_s": times["jaxserve"][0],
                     "ratio": times["jaxserve"][0] / times["transformers"][0],
                     "repeated_image_s": repeated[0], "fresh_image_s": fresh[0]})
        print(rows[-1], flush=True)
    medians = {key: statistics.median(row[key] for row in rows)
               for key in ("transformers_s", "jaxserve_s", "ratio", "repeated_image_s", "fresh_image_s")}
    print(common.machine_line(info))
    print(common.format_table(rows, [("round", "round", "d"), ("prompt_tokens", "prompt tokens", "d"),
                                     ("transformers_s", "transformers s", ".3f"), ("jaxserve_s", "jaxserve s", ".3f"),
                                     ("ratio", "x transformers", ".2f"), ("fresh_image_s", "fresh image s", ".3f"),
                                     ("repeated_image_s", "repeated image s", ".3f")]))
    print(f"medians: {medians}; first tokens agree in {agree} of {args.rounds} rounds; encoder cache: "
          f"{engine.scheduler.encoder_cache.num_hits} hits, {engine.scheduler.encoder_cache.num_encoded} encoded")
    if args.out:
        common.write_json(args.out, {"machine": info, "args": vars(args), "rounds": rows, "medians": medians,
                                     "first_tokens_agree": agree})
    return 0


if __name__ == "__main__":
    sys.exit(main())
