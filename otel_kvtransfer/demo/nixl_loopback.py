"""Real NIXL agents on 127.0.0.1 (UCX): the NIXL counterpart of `demo.loopback`'s Mooncake engines.

Same interface, so the demo and bench/ can drive either engine: `open_engine()` gives a sender whose
`register_memory`, `batch_transfer_sync_write` and `transfer_sync_write` have Mooncake's signatures and return
codes (0 on success) but move the bytes with a NIXL agent (`initialize_xfer("WRITE", ...)`, `transfer`, polling
`check_xfer_state` until DONE or ERR, then `release_xfer_handle`), and `Receiver` runs an agent with a registered
buffer in a spawned process, answering checksum requests and, given a span file, recording `kv_transfer.receive`
spans. A receiver's `session` is its agent name; the sender learns the agent's metadata from the `Receiver`
object created in the same process (no listener socket is opened for metadata).
UCX is kept to the loopback device (UCX_NET_DEVICES=lo unless set): its TCP transport listens on the address of
every device it may use.
"""

import itertools
import os
import time
from typing import Any, Dict, Optional

from otel_kvtransfer.demo.loopback import ReceiverProcess, _decode_side_tracing, serve_requests

LOOPBACK = "127.0.0.1"
_POLL_S = 50e-6
_TRANSFER_TIMEOUT_S = 60.0
_peers: Dict[Any, Any] = {}  # agent name -> agent metadata, filled by the Receivers of this process
_names = itertools.count()


class NixlUnavailable(RuntimeError):
    """NIXL cannot be loaded here; the message says how to fix it."""


def _api():
    # Loopback only: UCX's TCP transport listens on the address of every device it may use.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        import nixl._api as api
    except ImportError as exc:
        raise NixlUnavailable(
            f"NIXL is not installed ({exc}); install it with "
            "`pip install --no-deps -r scripts/requirements-nixl.txt`") from exc
    return api


def _new_agent(role: str):
    api = _api()
    name = f"kvt-{role}-{os.getpid()}-{next(_names)}"
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _register(agent, address: int, nbytes: int):
    return agent.register_memory(agent.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))


class NixlEngine:
    """A NIXL agent behind the Mooncake-style calls the demo makes."""

    def __init__(self):
        self.agent = _new_agent("prefill")
        self._registered = []
        self._connected = set()

    @property
    def name(self) -> str:
        return self.agent.name

    def register_memory(self, address: int, nbytes: int) -> int:
        try:
            self._registered.append(_register(self.agent, address, nbytes))
        except Exception:
            return -1
        return 0

    def _connect(self, session: str) -> None:
        if session not in self._connected:
            if session not in _peers:
                raise NixlUnavailable(f"no NIXL receiver named {session!r} was started in this process")
            self.agent.add_remote_agent(_peers[session])
            self._connected.add(session)

    def batch_transfer_sync_write(self, session: str, srcs, dsts, lens) -> int:
        try:
            self._connect(session)
            local = self.agent.get_xfer_descs([(s, n, 0) for s, n in zip(srcs, lens)], "DRAM")
            remote = self.agent.get_xfer_descs([(d, n, 0) for d, n in zip(dsts, lens)], "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, session)
        except Exception:
            return -1
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + _TRANSFER_TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                state = self.agent.check_xfer_state(handle)
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                pass  # still in flight after the timeout: NIXL keeps it and frees it with the agent
        return 0 if state == "DONE" else -1

    def transfer_sync_write(self, session: str, src: int, dst: int, length: int) -> int:
        return self.batch_transfer_sync_write(session, [src], [dst], [length])


def open_engine() -> NixlEngine:
    """A NIXL agent (UCX backend) ready to write to the Receivers started in this process."""
    return NixlEngine()


def session_of(engine: NixlEngine) -> str:
    return engine.name


def _receiver_main(conn, size: int, env: dict, span_file: Optional[str], service_name: str) -> None:
    os.environ.update(env)
    import numpy as np

    from otel_kvtransfer.engines.nixl import BACKEND

    provider = _decode_side_tracing(span_file, service_name) if span_file else None
    try:
        agent = _new_agent("decode")
        buffer = np.zeros(size, dtype=np.uint8)
        buffer.fill(0)  # fault the pages in now, as a real engine's KV pool is
        _register(agent, buffer.ctypes.data, buffer.nbytes)
        metadata = agent.get_agent_metadata()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(0)
    conn.send(("ready", agent.name, metadata, buffer.ctypes.data, size))

    def notifications():  # what initiators attached to their transfers (notif_msg)
        return [bytes(n[:256]).decode("utf-8", "replace")
                for notifs in agent.get_new_notifs().values() for n in notifs]

    serve_requests(conn, buffer, BACKEND, provider, extra={"notifications": notifications})
    # NIXL/UCX teardown at interpreter exit can crash after a transfer; everything is flushed by now.
    os._exit(0)


class Receiver(ReceiverProcess):
    """A NIXL agent with `size` registered bytes in its own (spawned) process."""

    main = staticmethod(_receiver_main)
    unavailable = NixlUnavailable

    def __init__(self, size: int, env: Optional[dict] = None, start_timeout_s: float = 60.0,
                 span_file: Optional[str] = None, service_name: str = "kv-decode"):
        _api()  # fail here, with the fix, rather than in the child
        super().__init__(size, env, start_timeout_s, span_file, service_name)

    def _ready(self, reply) -> None:
        _, self.session, metadata, self.base_address, self.size = reply
        _peers[self.session] = metadata

    def notifications(self) -> list:
        """The notification messages that arrived since the last call (NIXL-only: Mooncake has none)."""
        return self._ask(("notifications",))

    def kill(self) -> None:
        super().kill()
        _peers.pop(getattr(self, "session", None), None)
