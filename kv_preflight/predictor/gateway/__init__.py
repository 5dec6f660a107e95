"""``kv-preflight gateway``: a predictor that also forwards the request (docs/gateway.md).

An OpenAI-compatible proxy in front of the engines: each request is tokenized once, routed by ``/route``'s
decision (the same code: kv_preflight/predictor/prediction.py, scoring/route.py), forwarded to the chosen
engine through one pooled HTTP client and answered byte for byte, with the decision in ``x-kvpf-*`` headers.
``openai.py`` reads what routing needs from the body, ``engines.py`` knows where each pod's engine answers,
``forward.py`` talks to it, ``app.py`` puts them behind the predictor's own routes, ``serve.py`` runs it.
"""
