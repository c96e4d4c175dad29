"""A Redis Sentinel setup on loopback for tests: a primary, one replica, three sentinels.

Every process is an EmbeddedRedis on a free 127.0.0.1 port with a temp dir of its
own; the primary and the replica keep an AOF like every tokenrelay Redis. Timings
are short (down after 1 s, failover timeout 3 s), so a killed primary is replaced
in about 2-3 s.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import redis
from redis.client import PubSub

from gateway.redis_server import START_ATTEMPTS, EmbeddedRedis, PortInUse, free_ports
from tests.service import wait_until

SERVICE_NAME = "tokenrelay"
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


class EmbeddedSentinel(EmbeddedRedis):
    """A redis-server in sentinel mode watching `primary_port`.

    Its config file (which Sentinel rewrites as it learns) lives in its data dir. It
    starts knowing its peers and the replica, so the sentinels need not first find
    each other through hello messages (one every 2 s) before they can vote.
    """

    def __init__(self, port: int, myid: str, primary_port: int, replica_port: int,
                 peers: Sequence[tuple[int, str]]) -> None:
        super().__init__(port)
        self.myid = myid
        self._config = [
            f"sentinel myid {myid}",
            f"sentinel monitor {SERVICE_NAME} 127.0.0.1 {primary_port} {QUORUM}",
            f"sentinel down-after-milliseconds {SERVICE_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {SERVICE_NAME} 1",
            f"sentinel known-replica {SERVICE_NAME} 127.0.0.1 {replica_port}",
            *(f"sentinel known-sentinel {SERVICE_NAME} 127.0.0.1 {port} {peer}" for port, peer in peers),
        ]

    def command(self) -> list[str]:
        conf = self.data_dir / "sentinel.conf"
        if not conf.exists():  # a restart keeps what this sentinel has learnt since
            conf.write_text("\n".join(self._config) + "\n")
        return [self.binary, str(conf), "--sentinel", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--loglevel", "warning"]


class SentinelCluster:
    """Start with `with SentinelCluster() as cluster:`; `cluster.url` is the redis+sentinel:// URL."""

    def __init__(self, num_sentinels: int = 3) -> None:
        self.num_sentinels = num_sentinels
        self._switches: PubSub | None = None  # subscribed to +switch-master by kill_primary()
        self._build()

    def _build(self) -> None:
        """Processes on fresh distinct ports: every one knows the others' ports before it starts."""
        self.primary_port, replica_port, *sentinel_ports = free_ports(2 + self.num_sentinels)
        self.servers = {
            self.primary_port: EmbeddedRedis(self.primary_port),
            replica_port: EmbeddedRedis(replica_port, extra_args=("--replicaof", "127.0.0.1",
                                                                  str(self.primary_port))),
        }
        ids = [(port, secrets.token_hex(20)) for port in sentinel_ports]  # (port, myid)
        self.sentinels = [EmbeddedSentinel(port, myid, self.primary_port, replica_port,
                                           [peer for peer in ids if peer[1] != myid])
                          for port, myid in ids]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE_NAME}/0"

    @property
    def replica_ports(self) -> list[int]:
        return [port for port in self.servers if port != self.primary_port]

    def start(self) -> SentinelCluster:
        for attempt in range(START_ATTEMPTS):
            try:
                for server in (*self.servers.values(), *self.sentinels):
                    server.start()
                break
            except PortInUse:  # someone took a port between free_ports() and its bind: all anew
                if attempt == START_ATTEMPTS - 1:
                    raise
                self.stop()
                self._build()
        wait_until(self._is_ready, timeout=10, interval=0.05)
        return self

    def _is_ready(self) -> bool:
        """The replica is in sync and every sentinel sees the primary, its peers and the replica up."""
        with _client(self.replica_ports[0]) as replica:
            if replica.info("replication").get("master_link_status") != "up":
                return False
        return all(self._sees_everything(s.port) for s in self.sentinels)

    def _sees_everything(self, sentinel_port: int) -> bool:
        with _client(sentinel_port) as sentinel:
            master = sentinel.sentinel_master(SERVICE_NAME)
            replicas = sentinel.sentinel_slaves(SERVICE_NAME)
        return (master["port"] == self.primary_port and master["is_master"] and not master["is_sdown"]
                and master["num-other-sentinels"] == len(self.sentinels) - 1
                and any(r["port"] in self.replica_ports and not r["is_sdown"] for r in replicas))

    def kill_primary(self) -> None:
        """SIGKILL the primary; the sentinels notice after DOWN_AFTER_MS and promote the replica."""
        self._switches = _client(self.sentinels[0].port).pubsub()
        self._switches.subscribe("+switch-master")
        # Read the confirmation, so the subscription exists before the event can happen.
        self._switches.get_message(timeout=5)
        self.servers[self.primary_port].kill()

    def wait_for_failover(self, timeout_s: float = 15.0) -> int:
        """The new primary's port, once a sentinel has switched to it (after `kill_primary()`)."""
        switches, self._switches = self._switches, None
        if switches is None:
            raise RuntimeError("wait_for_failover() follows kill_primary()")
        # +switch-master carries "<name> <old ip> <old port> <new ip> <new port>".
        message = wait_until(lambda: switches.get_message(timeout=0.5), timeout=timeout_s, interval=0)
        switches.close()
        new_port = int(message["data"].split()[4])
        self.primary_port = new_port
        return new_port

    def stop(self) -> None:
        if self._switches is not None:
            self._switches.close()
        for sentinel in self.sentinels:  # first, so that stopping the servers starts no failover
            sentinel.stop()
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> SentinelCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, decode_responses=True, socket_timeout=2, protocol=2)
