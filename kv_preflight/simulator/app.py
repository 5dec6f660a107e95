"""The simulator's HTTP surface: the slice of vLLM 0.32's OpenAI server that prefix-cache tools use.

Request validation and error bodies follow vLLM's (``{"error": {message, type,
param, code}}``), including its max_tokens rules: completions default to 16,
chat to the rest of the context, and both are clamped to
``max_model_len - prompt_tokens``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kv_preflight.simulator import tokenizer
from kv_preflight.simulator.config import SimulatorConfig
from kv_preflight.simulator.engine import Generation
from kv_preflight.simulator.runner import EngineRunner

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
FINGERPRINT = "vllm-0.32.0-kv-preflight-simulator"


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _token_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _prompt_ids(prompt: Any, add_special_tokens: bool = True) -> list[int]:
    """A string (tokenized, BOS first) or a list of token ids (as given); one prompt only."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        return tokenizer.encode(prompt, add_bos=add_special_tokens)
    ids = _token_list(prompt)
    if ids is None and isinstance(prompt, list) and len(prompt) == 1:
        inner = prompt[0]
        return _prompt_ids(inner, add_special_tokens) if isinstance(inner, (str, list)) else _prompt_ids(None)
    if ids is None:
        if isinstance(prompt, list) and prompt:
            raise ApiError("batched prompts are not supported by the simulator; send one prompt per request",
                           param="prompt")
        raise ApiError("You must pass at least one prompt", param="prompt")
    if any(t < 0 or t > 0xFFFFFFFF for t in ids):
        raise ApiError("token ids must be in [0, 2**32)", param="prompt")
    return ids


def _messages_ids(body: dict[str, Any]) -> list[int]:
    try:
        return tokenizer.apply_chat_template(
            body.get("messages"), add_generation_prompt=bool(body.get("add_generation_prompt", True))
        )
    except tokenizer.TemplateError as exc:
        raise ApiError(str(exc), param="messages") from None


DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM 0.32 (openai/completion/serving.py): pins a request to a rank


async def _until_client_leaves(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancellable(request: Request, work):
    """``work``'s result, or None once the client has gone away, ``work`` cancelled: vLLM aborts a request whose
    client disconnected (its ``with_cancellation`` on the OpenAI routes), freeing its blocks at once."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_client_leaves(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


# vLLM 0.32's series the simulator exports (name, type, help), each per engine core (label engine="<rank>")
_METRICS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed."),
)


class SimulatorApp:
    """Routes bound to the engine runners (one per data-parallel rank) and config; build with ``.starlette()``."""

    def __init__(self, cfg: SimulatorConfig, runners: EngineRunner | list[EngineRunner]) -> None:
        self.cfg = cfg
        self.runners = runners if isinstance(runners, list) else [runners]
        self.runner = self.runners[0]
        self.created = int(time.time())
        self._next = 0  # the rank an unpinned request goes to among equally loaded ones (round robin)

    def _rank_for(self, request: Request) -> EngineRunner:
        """The rank a request runs on: the one ``X-data-parallel-rank`` names (vLLM refuses one out of range), else
        the least loaded (running + waiting), ties in turn, as vLLM's data-parallel balancer spreads them."""
        pinned = request.headers.get(DP_RANK_HEADER)
        if pinned is not None:
            if not pinned.strip().isdigit() or int(pinned) >= len(self.runners):
                raise ApiError(f"data_parallel_rank {pinned!r} is out of range [0, {len(self.runners)})",
                               param=DP_RANK_HEADER)
            return self.runners[int(pinned)]
        n = len(self.runners)
        order = [(self._next + i) % n for i in range(n)]
        rank = min(order, key=lambda r: self.runners[r].counters.running + self.runners[r].counters.waiting)
        self._next = (rank + 1) % n
        return self.runners[rank]

    # ---- helpers ----

    def _check_model(self, body: dict[str, Any]) -> tuple[str, int] | None:
        """The LoRA adapter a request names (its name and id: 1, 2, ... as served), None for the model; 404 for
        any other name."""
        model = body.get("model")
        if model is None or model == self.cfg.model:
            return None
        if model in self.cfg.adapters:
            return model, self.cfg.adapters.index(model) + 1
        raise ApiError(f"The model `{model}` does not exist. Valid aliases: {self.cfg.model}.",
                       status=404, kind="NotFoundError", param="model")

    def _served(self, gen: Generation) -> str:
        """The model name an answer gives: the adapter's for an adapter's request, as vLLM answers."""
        return gen.lora[0] if gen.lora else self.cfg.model

    def _max_tokens(self, body: dict[str, Any], num_prompt: int, default: int | None) -> int:
        limit = self.cfg.max_model_len
        if num_prompt > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{num_prompt} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.", param="input_tokens")
        requested = body.get("max_completion_tokens", body.get("max_tokens"))
        if requested is None:
            requested = default if default is not None else limit - num_prompt
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise ApiError("max_tokens must be an integer", param="max_tokens")
        if requested > limit:
            raise ApiError(f"max_tokens={requested} cannot be greater than max_model_len={limit}. "
                           "Please request fewer output tokens.", param="max_tokens")
        max_tokens = min(requested, limit - num_prompt)
        if max_tokens < 1:
            raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        usable = self.cfg.num_blocks - 1
        if self.runner.blocks_needed(num_prompt, max_tokens) > usable:
            # vLLM would leave such a request waiting forever; say so instead.
            raise ApiError(f"request needs {self.runner.blocks_needed(num_prompt, max_tokens)} KV blocks "
                           f"but the pool has {usable}", param="max_tokens")
        return max_tokens

    def _usage(self, gen: Generation, chat: bool) -> dict[str, Any]:
        return {
            "prompt_tokens": len(gen.prompt_ids),
            "total_tokens": len(gen.prompt_ids) + len(gen.output_ids),
            "completion_tokens": len(gen.output_ids),
            # vLLM 0.32 reports created_cache_tokens as null for completions and 0 for chat.
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens,
                                      "created_cache_tokens": 0 if chat else None, "multimodal_tokens": None},
            "completion_tokens_details": None,
        }

    # ---- routes ----

    async def completions(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            lora = self._check_model(body)
            prompt_ids = _prompt_ids(body.get("prompt"), bool(body.get("add_special_tokens", True)))
            max_tokens = self._max_tokens(body, len(prompt_ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
            runner = self._rank_for(request)
        except ApiError as exc:
            return exc.response()
        gen = await cancellable(request, runner.generate(prompt_ids, max_tokens, lora))
        if gen is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        rid, text = f"cmpl-{uuid.uuid4().hex[:16]}", tokenizer.decode(gen.output_ids)
        if body.get("stream"):
            chunk = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            return self._stream(rid, "text_completion", chunk, gen, body, chat=False)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": self._served(gen),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}],
            "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": self._usage(gen, chat=False),
            "kv_transfer_params": None,
        })

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            lora = self._check_model(body)
            prompt_ids = _messages_ids(body)
            max_tokens = self._max_tokens(body, len(prompt_ids), None)
            runner = self._rank_for(request)
        except ApiError as exc:
            return exc.response()
        gen = await cancellable(request, runner.generate(prompt_ids, max_tokens, lora))
        if gen is None:
            return Response(status_code=499)
        rid, text = f"chatcmpl-{uuid.uuid4().hex[:16]}", tokenizer.decode(gen.output_ids)
        if body.get("stream"):
            chunk = {"index": 0, "delta": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": "length", "stop_reason": None}
            return self._stream(rid, "chat.completion.chunk", chunk, gen, body, chat=True)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self._served(gen),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                 "tool_calls": [], "reasoning": None},
                         "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}],
            "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": self._usage(gen, chat=True),
            "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
        })

    def _stream(self, rid: str, obj: str, choice: dict[str, Any], gen: Generation, body: dict[str, Any],
                chat: bool) -> StreamingResponse:
        """One content chunk, then usage when ``stream_options.include_usage`` asks; the request already ran."""
        opts = body.get("stream_options") or {}

        async def events() -> AsyncIterator[bytes]:
            base = {"id": rid, "object": obj, "created": int(time.time()), "model": self._served(gen)}
            yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode()
            if isinstance(opts, dict) and opts.get("include_usage"):
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': self._usage(gen, chat)})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            self._check_model(body)
            if "messages" in body:
                ids = _messages_ids(body)
            else:
                ids = _prompt_ids(body.get("prompt"), bool(body.get("add_special_tokens", True)))
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: ``{"model", "tokens"}`` -> ``{"prompt": text}`` (kv-preflight explain uses it)."""
        try:
            body = await _json_body(request)
            self._check_model(body)
            ids = _token_list(body.get("tokens"))
            if ids is None:
                raise ApiError("tokens must be a list of token ids", param="tokens")
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def kv_event_sources(self, request: Request) -> Response:
        sources: dict[str, Any] = {}
        for runner in self.runners:
            sources.update(runner.publisher.sources())
        return JSONResponse(sources)

    async def reset_prefix_cache(self, request: Request) -> Response:
        # every rank, as vLLM resets each engine core's cache (each refuses while it holds running blocks)
        return JSONResponse({"success": all([runner.reset_prefix_cache() for runner in self.runners])})

    async def models(self, request: Request) -> Response:
        card = {"id": self.cfg.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.max_model_len, "permission": []}
        # vLLM lists each LoRA adapter after its base, the base as its parent
        adapters = [{**card, "id": a, "root": f"/adapters/{a}", "parent": self.cfg.model, "max_model_len": None}
                    for a in self.cfg.adapters]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        lines: list[str] = []
        for i, (name, kind, help_text) in enumerate(_METRICS):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for rank, runner in enumerate(self.runners):  # one series per engine core, as vLLM labels them
                c = runner.counters
                value = (c.running, c.waiting, runner.cache.usage, c.prefix_cache_queries, c.prefix_cache_hits,
                         c.prompt_tokens, c.generation_tokens)[i]
                lines.append(f'{name}{{engine="{rank}",model_name="{self.cfg.model}"}} {float(value)!r}')
        lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
                  "# TYPE vllm:request_success_total counter"]
        for rank, runner in enumerate(self.runners):
            c = runner.counters
            for reason, n in (("length", c.requests_finished), ("abort", c.requests_aborted)):
                lines.append(f'vllm:request_success_total{{engine="{rank}",finished_reason="{reason}",'
                             f'model_name="{self.cfg.model}"}} {float(n)!r}')
        # vLLM's CacheConfig as an info metric: the KV pool's size (a gateway reads its capacity from it)
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge"]
        for rank in range(len(self.runners)):
            lines.append(f'vllm:cache_config_info{{block_size="{self.cfg.block_size}",enable_prefix_caching="True",'
                         f'engine="{rank}",num_gpu_blocks="{self.cfg.num_blocks}"}} 1.0')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    def starlette(self, lifespan: Any = None) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/kv_event_sources", self.kv_event_sources, methods=["GET"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            lifespan=lifespan,
        )
