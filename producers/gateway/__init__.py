"""``conveyor gateway``: Conveyor over HTTP, in the Open Inference Protocol (KServe v2),
and in OpenAI's API for generation models.

A stateless HTTP server in front of the queue, a client of it like any other: each
infer call is sent to the model's request topic through the SDK and answered from its
result in Redis (docs/http.md).

- ``settings``: ``GatewaySettings``, a ``ClientSettings`` plus the server's own;
- ``oip``: the protocol's request and response bodies (JSON, binary tensor data);
- ``openai_requests``, ``openai_answers``: OpenAI's bodies as generation requests, and
  its answers (whole, stream chunks, errors);
- ``refusals``: the HTTP status and code of each refusal, whatever the protocol;
- ``service``: ``Gateway``, the queue side: claims, sends, waits, lag, descriptions;
- ``backlog``: the model's consumer-group lag, for back-pressure;
- ``http``: the Starlette application and its routes (``openai_routes``: the ``/v1`` ones);
- ``command``: the ``conveyor gateway`` command, on uvicorn.

Only ``command`` is imported by the ``conveyor`` command; the others need the
``gateway`` extra (starlette, uvicorn, prometheus-client).
"""
