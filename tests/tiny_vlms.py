"""Tiny random vision-language models with a real tokenizer, for tests of image input end to end.

`make_vlm(family, folder)` saves a Hugging Face folder of a random `Qwen2_5_VLForConditionalGeneration`
("qwen") or `Gemma3ForConditionalGeneration` ("gemma"): every weight random (the projector too, so
an image changes the answer), SmolLM2's tokenizer with the family's image tokens added as special
tokens (and named in `extra_special_tokens`, so transformers' processors find them), a chat
template that places the family's image placeholder for each image part, and the image
processor's files. `convert_vlm` converts it (checkpoints.convert). `hf_processor` is
transformers' processor of the folder, the reference for prompt ids and pixels.
"""
from __future__ import annotations

import json
import os

SEED = 1234
# The chat template of both families: ChatML turns (SmolLM2's tokens), an image part written as the
# family's placeholder (Qwen: <|vision_start|><|image_pad|><|vision_end|>; Gemma 3: <start_of_image>).
_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}IMAGE"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
FAMILY_TOKENS = {
    "qwen": {"image_token": "<|image_pad|>", "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
             "video_token": "<|video_pad|>"},
    "gemma": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
}
PLACEHOLDER = {"qwen": "<|vision_start|><|image_pad|><|vision_end|>", "gemma": "<start_of_image>"}
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                   fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2)
QWEN_PROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
SIGLIP = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=14, vision_use_head=False)
GEMMA_TOKENS_PER_IMAGE = 4


def _tokenizer(family: str, folder: str):
    """SmolLM2's tokenizer with the family's image tokens, saved into `folder`; returns it."""
    from transformers import AutoTokenizer

    from tests.tiny_models import copy_smollm2_tokenizer
    copy_smollm2_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = FAMILY_TOKENS[family]
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tokenizer.chat_template = _TEMPLATE.replace("IMAGE", PLACEHOLDER[family])
    tokenizer.save_pretrained(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["extra_special_tokens"] = {k: v for k, v in tokens.items() if k in ("image_token", "boi_token", "eoi_token")}
    with open(path, "w") as f:
        json.dump(config, f)
    return AutoTokenizer.from_pretrained(folder)


def randomize(model, gemma: bool, strong_projection: bool = False):
    """Every parameter random (transformers starts norms at one and biases at zero); Gemma's text
    norms and projector norm scale by 1 + w, so theirs stay near zero. `strong_projection`:
    Gemma's image rows as large as its scaled text embeddings (so an image moves the answer)."""
    import torch
    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                zero_based = gemma and ("language_model" in name or "mm_soft_emb_norm" in name)
                p.copy_((0.0 if zero_based else 1.0) + 0.1 * torch.randn_like(p))
            elif strong_projection and "mm_input_projection" in name:
                p.copy_(torch.randn_like(p) * 4.0 / p.shape[0] ** 0.5)
            elif p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.5 / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def make_vlm(family: str, folder: str, *, hidden_size: int = 64, num_layers: int = 2, intermediate_size: int = 96,
             num_heads: int | None = None, qwen_vision: dict | None = None, qwen_processor: dict | None = None):
    """Saves the tiny random VLM of `family` with its tokenizer and image processor into `folder`;
    returns the torch model (float32, eval). Widths are parameters (the benchmark's model is wider)."""
    import transformers
    os.makedirs(folder, exist_ok=True)
    tokenizer = _tokenizer(family, folder)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in FAMILY_TOKENS[family].items()}
    vocab = len(tokenizer)
    heads = num_heads or max(hidden_size // 32, 2)
    if family == "qwen":
        text = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                    num_attention_heads=heads, num_key_value_heads=max(heads // 8, 1), vocab_size=vocab, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                    rope_parameters={"rope_type": "default", "mrope_section": _section(hidden_size // heads),
                                     "rope_theta": 10000.0})
        vision = dict(qwen_vision or QWEN_VISION, out_hidden_size=hidden_size)
        config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text,
                                               image_token_id=ids["image_token"], video_token_id=ids["video_token"],
                                               vision_start_token_id=ids["vision_start"],
                                               vision_end_token_id=ids["vision_end"])
        config.vision_config._attn_implementation = "eager"
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        Qwen2VLImageProcessorPil(**(qwen_processor or QWEN_PROCESSOR)).save_pretrained(folder)
    else:
        head_dim = hidden_size // heads
        text = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                    num_attention_heads=heads, num_key_value_heads=max(heads // 8, 1), head_dim=head_dim, vocab_size=vocab,
                    max_position_embeddings=2048, query_pre_attn_scalar=head_dim, sliding_window=8,
                    layer_types=(["sliding_attention", "full_attention"] * num_layers)[:num_layers],
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        config = transformers.Gemma3Config(vision_config=SIGLIP, text_config=text,
                                           mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE,
                                           image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                                           eoi_token_index=ids["eoi_token"])
        config.vision_config._attn_implementation = "eager"
        model = transformers.Gemma3ForConditionalGeneration(config).eval()
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
        with open(os.path.join(folder, "processor_config.json"), "w") as f:
            json.dump({"image_seq_length": GEMMA_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}, f)
    model.config.text_config._attn_implementation = "eager"
    randomize(model, gemma=family == "gemma", strong_projection=True)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return model


def _section(head_dim: int) -> list[int]:
    half = head_dim // 2
    first = half - 2 * (half * 3 // 8)
    return [first, half * 3 // 8, half * 3 // 8]


def convert_vlm(folder: str, out: str):
    """The converted directory of a `make_vlm` folder; returns its ModelConfig."""
    from checkpoints.convert import convert_checkpoint
    return convert_checkpoint(folder, out)


def hf_processor(family: str, folder: str):
    """transformers' processor (PIL image processor) of a `make_vlm` folder. (Its parts' class
    check is skipped: it looks the video processor up in registries that want torchvision.)"""
    import transformers
    from transformers import AutoTokenizer
    from transformers.processing_utils import ProcessorMixin
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if family == "qwen":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        return transformers.Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(**QWEN_PROCESSOR),
                                                tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    return transformers.Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                        tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                        image_seq_length=GEMMA_TOKENS_PER_IMAGE)


def hf_generate(model, processor, messages: list[dict], images: list, max_new_tokens: int,
                causal_images: bool = False) -> tuple[list[int], "np.ndarray", list[int]]:
    """transformers' greedy tokens for template `messages` ({"type": "image"} parts) and their
    `images` (PIL), the first token's log-softmax, and the processor's prompt ids.
    `causal_images`: Gemma 3 without token_type_ids (its image tokens then attend causally)."""
    import torch
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    if causal_images:
        inputs.pop("token_type_ids", None)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    first = torch.log_softmax(out.scores[0][0].float(), -1).numpy()
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), first, inputs["input_ids"][0].tolist()


def random_image(seed: int, width: int = 56, height: int = 56):
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
