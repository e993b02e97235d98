"""The OpenAI-compatible wire: request and response models, errors, limits, streaming.

    protocol.py       pydantic models of the OpenAI chat and completion requests and responses
    errors.py         APIError and the OpenAI-style error body
    openai_format.py  engine outputs -> OpenAI responses and stream chunks
    limits.py         request limits checked before a request reaches the engine
    streaming.py      server-sent events
    api_keys.py       bearer-token checks
    request_log.py    one JSON line per finished request

Imports no other package of deployments/ and no Ray deployment; the ingress uses it.
"""
