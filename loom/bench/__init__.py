"""`loom bench`: a streaming load generator and the figures vLLM's `bench serve` reports.

    datasets      synthetic prompts of exact token lengths, or a JSONL file
    request       one streamed OpenAI request -> RequestRecord (timestamps of every chunk)
    runner        bounded async load generator (concurrency, Poisson rate, progress bar)
    metrics       throughput, TTFT / TPOT / ITL / E2E percentiles, goodput
    sweep         several concurrencies x several servers -> JSON + PNG
    server_proc   spawn a server, time /health and the first token, sample its memory
    offline       `LLM.generate` throughput
    cli           the `loom bench` subcommands
"""

# OpenAI endpoints the load generator drives; here so that building the CLI imports nothing heavy.
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
