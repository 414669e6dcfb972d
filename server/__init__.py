"""maxjax.server: the OpenAI-compatible HTTP server (aiohttp).

engine_client.py  the EngineClient protocol the server codes against, and QueueFullError
config.py         ServeConfig (the server's CLI flags)
app.py            build_app / run_server: routes, auth + error + metrics middleware, SIGTERM drain
openai_routes.py  /v1/chat/completions and /v1/completions (prompt -> params -> JSON or SSE)
generation.py     the n engine requests of one HTTP request: admission, merging, abort on close
protocol.py       pydantic request models, response builders, the OpenAI error envelope
state.py          per-app state shared by the routes (engine, config, metrics, tokenizer thread)
metrics.py        Prometheus registry: request/token counters, latency histograms, engine gauges
"""
