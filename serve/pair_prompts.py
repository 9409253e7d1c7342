"""A query and a document as one prompt, for a cross-encoder or a classification reranker.

As vLLM formats them: with a score template (`--chat-template` on a pooling server, e.g. the
prompt a converted Qwen3-Reranker was trained on: docs/examples/qwen3_reranker_score_template.jinja),
the template renders a conversation of two messages, role "query" and role "document", and its
text is encoded without further special tokens; without one, the tokenizer's own pair encoding
(`tokenizer(text=query, text_pair=document)`: BERT-style `[CLS] q [SEP] d [SEP]` where the
tokenizer defines it; a decoder tokenizer's BOS, then the two texts). An embedding model scores
by the cosine of the two texts' own embeddings instead (jaxserve.pooling.accumulate.cosine_scores).
"""
from __future__ import annotations

QUERY_ROLE, DOCUMENT_ROLE = "query", "document"


def pair_messages(query: str, document: str) -> list[dict[str, str]]:
    """The conversation a score template renders."""
    return [{"role": QUERY_ROLE, "content": query}, {"role": DOCUMENT_ROLE, "content": document}]


def pair_text(tokenizer, query: str, document: str, template: str) -> str:
    """The prompt text `template` (a Jinja chat template) makes of the pair."""
    return tokenizer.apply_chat_template(pair_messages(query, document), chat_template=template, tokenize=False,
                                         add_generation_prompt=False)


def encode_pair(tokenizer, query: str, document: str, template: str | None = None) -> list[int]:
    """The token ids of the pair: the score template's text, or the tokenizer's pair encoding."""
    if template is not None:
        return list(tokenizer(pair_text(tokenizer, query, document, template), add_special_tokens=False)["input_ids"])
    return list(tokenizer(text=query, text_pair=document, add_special_tokens=True)["input_ids"])
