"""OpenAI-compatible HTTP server for jaxserve (aiohttp): routes, SSE streaming, /health, /metrics."""
