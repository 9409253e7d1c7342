"""`jaxserve bench serve|throughput|latency`: the benchmarks a user runs, with vLLM's `vllm bench`
semantics and result field names where they overlap. Host code: the serve benchmark is an HTTP
client (no jax); throughput and latency drive an in-process engine."""
