"""The simulator's one typed config, filled by ``kv-preflight simulate`` or by tests."""
from __future__ import annotations

from dataclasses import dataclass

from kv_preflight.events import make_topic
from kv_preflight.simulator.hybrid_cache import FULL_ATTENTION, SLIDING_WINDOW, KVCacheGroup


@dataclass(frozen=True)
class SimulatorConfig:
    pod: str
    model: str
    port: int = 8000
    host: str = "127.0.0.1"
    # vLLM's --kv-events-config endpoint: binds when it holds "*", connects otherwise.
    zmq_endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5558"
    block_size: int = 16
    # vLLM's --num-gpu-blocks-override: includes the reserved null block.
    num_blocks: int = 256
    max_model_len: int = 512
    buffer_steps: int = 10_000
    # Wall time per engine step, so running/waiting and mid-request resets can be observed.
    step_delay_s: float = 0.0
    # The PUB topic; None is kv@POD@MODEL. "" is vLLM's default (``KVEventsConfig.topic``), as Dynamo's
    # workers publish: the subscriber then names the pod from its registration.
    topic_override: str | None = None
    # A hybrid model: a sliding-window layer (this window, in tokens) beside a full-attention one, so the
    # engine runs vLLM's hybrid KV cache manager with two KV cache groups. None: a plain model, one group.
    sliding_window: int | None = None
    # vLLM's --data-parallel-size: this many engine cores behind the one HTTP port, each with its own prefix
    # cache and its own publisher on the event and replay ports + its rank (vLLM's offset_endpoint_port); a
    # request goes to the rank its X-data-parallel-rank header names, else to the least loaded.
    dp_size: int = 1

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...] | None:
        """The hybrid engine's groups in vLLM 0.32's numbering for tiny-hybrid-model (its sliding-window
        layer comes first: group 0, as its events say), or None for a plain engine."""
        if self.sliding_window is None:
            return None
        return (KVCacheGroup(SLIDING_WINDOW, self.sliding_window), KVCacheGroup(FULL_ATTENTION))

    def rank_endpoint(self, endpoint: str | None, rank: int) -> str | None:
        """``endpoint`` for data-parallel rank ``rank``: a tcp port + rank (0 left to the OS), an ipc or inproc path
        + ``_dp<rank>``, as vLLM 0.32's ``KVEventsConfig.offset_endpoint_port`` makes them."""
        if not endpoint or rank == 0:
            return endpoint
        if endpoint.startswith("tcp://"):
            base, _, port = endpoint.rpartition(":")
            return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
        return f"{endpoint}_dp{rank}"

    @property
    def topic(self) -> str:
        return make_topic(self.pod, self.model) if self.topic_override is None else self.topic_override

    def validate(self) -> None:
        if not self.pod or "@" in self.pod:
            raise ValueError("pod must be non-empty and contain no '@' (the topic is kv@pod@model)")
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks < 2:
            raise ValueError("blocks must be at least 2 (vLLM reserves one null block)")
        if self.max_model_len <= 1:
            raise ValueError("max_model_len must be at least 2")
        if self.buffer_steps <= 0:
            raise ValueError("buffer_steps must be positive")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError("sliding window must be at least 2 tokens")
        if not 1 <= self.dp_size <= 64:
            raise ValueError("data-parallel size must be between 1 and 64")
        if self.step_delay_s < 0:
            raise ValueError("step delay must not be negative")
