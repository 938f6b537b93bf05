"""`tokenpipe serve`: the OpenAI-compatible HTTP front end over the supervisor client API.

Modules: `app.py` (the ASGI app and its routes), `cli.py` (the click command),
`templates.py` (sandboxed chat templates), `tool_parsers.py` (tool-call and thinking markup),
`sessions.py` (session ids and assistant-turn splicing), `params.py` (request validation),
`chunks.py` (response and SSE chunk building), `metrics.py` (Prometheus text),
`errors.py` (the OpenAI error envelope).
"""
