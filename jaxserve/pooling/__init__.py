"""Pooling: embeddings, scores and classes from a decoder's hidden states (vLLM's pooling runner).

`config` resolves how a model pools (host side, no jax); `poolers` is the math over a step's
hidden states (jax); `accumulate` combines the chunks of one prompt and finishes its embedding
(host side, numpy).
"""
