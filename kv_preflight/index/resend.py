"""redis-py, as the index configures it: the resend rule of the lean connection (kv_preflight/index/resp.py, its
module docstring) for every command that goes through redis-py, and no maintenance notifications."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from kv_preflight.index.resp import can_run_twice

try:  # redis-py 6.2+; older releases have no maintenance notifications to turn off
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # pragma: no cover
    MaintNotificationsConfig = None


class ResendableConnectionError(RedisConnectionError):
    """Lost with the connection before the reply of commands that can run twice: the one error
    ``redis_client``'s Retry retries (once, on a fresh connection)."""


class _ResendGuard:
    """Mixed into redis-py's connection class (TCP, TLS or unix) by ``redis_client``: notes
    whether what is written can run twice, writes on a fresh connection when the server already
    closed this one, and turns a loss before the first reply into ResendableConnectionError."""

    resend_scripts: frozenset[str] = frozenset()
    _packed_twice = False  # the command(s) packed last can run twice
    _written_twice = False  # the command(s) written last can run twice
    _replies_read = 0  # replies read since that write

    def pack_command(self, *args: Any) -> Any:
        self._packed_twice = can_run_twice(args, self.resend_scripts)
        return super().pack_command(*args)

    def pack_commands(self, commands: Iterable[Any]) -> Any:
        commands = [tuple(c) for c in commands]
        packed = super().pack_commands(commands)
        self._packed_twice = all(can_run_twice(c, self.resend_scripts) for c in commands)
        return packed

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        twice = self._packed_twice  # read before a reconnect's handshake packs its own commands
        reader = getattr(self, "_reader", None)
        if self.is_connected and reader is not None and reader.at_eof():
            await self.disconnect(nowait=True)  # the server closed it before this write
        if not self.is_connected:
            await self.connect()  # outside the try: Valkey down is an error, not a resend
        try:
            await super().send_packed_command(command, check_health)
        except RedisConnectionError as exc:
            if type(exc) is RedisConnectionError and twice:
                raise ResendableConnectionError(str(exc)) from exc
            raise
        self._written_twice, self._replies_read = twice, 0

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            response = await super().read_response(*args, **kwargs)
        except RedisConnectionError as exc:
            # EOF or reset (exactly ConnectionError: not LOADING, AUTH or pool errors), no reply yet
            if type(exc) is RedisConnectionError and self._written_twice and self._replies_read == 0:
                raise ResendableConnectionError(str(exc)) from exc
            raise
        self._replies_read += 1
        return response


def redis_client(url: str, *, timeout_s: float, resend_scripts: Iterable[str] = ()) -> aioredis.Redis:
    """A redis-py client with the resend rule of the module docstring; reads bounded by timeout_s.

    redis-py 8 leaves maintenance notifications on "auto", and its pool then skips the check that
    replaces a pooled connection the server has closed: after a Valkey restart the next command
    on each such connection failed with "Connection closed by server". A private Valkey sends no
    such notifications, so they are off, which brings that check back.
    """
    kwargs: dict[str, Any] = {}
    if MaintNotificationsConfig is not None:
        kwargs["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    pool = aioredis.ConnectionPool.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0,
        retry=Retry(NoBackoff(), 1, supported_errors=(ResendableConnectionError,)), **kwargs,
    )
    base = pool.connection_class
    pool.connection_class = type(f"Resending{base.__name__}", (_ResendGuard, base),
                                 {"resend_scripts": frozenset(resend_scripts)})
    return aioredis.Redis.from_pool(pool)
