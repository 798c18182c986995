"""Every NATS subject Talaria uses, built in one place.

Layout (``<ns>`` is the deployment namespace, default ``talaria``; tests use a fresh one each)::

    <ns>.engine.<instance>.generate    request -> stream of TokenChunk on the reply inbox
    <ns>.engine.<instance>.cancel      CancelRequest (fire and forget)
    <ns>.engine.<instance>.control     ControlRequest -> ControlReply
    <ns>.engine.<instance>.heartbeat   InstanceSnapshot
    <ns>.engine.<instance>.round       round summaries   (cold pool)
    <ns>.engine.<instance>.switch      switch records    (cold pool)
    <ns>.engine.<instance>.retention   RetentionHint (router -> engine: predicted return gap of a session)
    <ns>.hook.completed                CompletionHook
    <ns>.hook.intent                   ToolIntent (a tool-call header seen mid-stream)
    <ns>.router.<router>.calls         CallRecord (call placed / ended; read by the telemetry service)
    <ns>.kvstore.<store>.stats         KvStoreStatsRecord (periodic; read by the telemetry service)
    <ns>.inbox.<router>.<id>           reply inboxes of one router process (one subscription to
                                       <ns>.inbox.<router>.*); the engine probes an inbox (a request
                                       carrying the PROBE_HEADER header) to find out whether its requester
                                       still listens: "no responders" (the router is gone) or an answer
                                       with PROBE_HEADER = PROBE_GONE (it dropped the call) = abort the call

Instance ids and namespaces are NATS tokens: no dots, spaces or wildcards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")

DEFAULT_NAMESPACE = "talaria"
LEASE_BUCKET = "leases"
PROBE_HEADER = "Talaria-Probe"  # a liveness probe on a reply inbox: not a chunk; answered with this header:
PROBE_LIVE = "live"  # the requester still reads the call
PROBE_GONE = "gone"  # the requester dropped the call: abort it


def check_token(value: str, what: str = "token") -> str:
    if not _TOKEN.match(value or ""):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '_' or '-'")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    def _engine(self, instance: str, endpoint: str) -> str:
        return f"{self.namespace}.engine.{check_token(instance, 'instance id')}.{endpoint}"

    def generate(self, instance: str) -> str:
        return self._engine(instance, "generate")

    def cancel(self, instance: str) -> str:
        return self._engine(instance, "cancel")

    def control(self, instance: str) -> str:
        return self._engine(instance, "control")

    def heartbeat(self, instance: str) -> str:
        return self._engine(instance, "heartbeat")

    def round(self, instance: str) -> str:
        return self._engine(instance, "round")

    def switch(self, instance: str) -> str:
        return self._engine(instance, "switch")

    def retention(self, instance: str) -> str:
        return self._engine(instance, "retention")

    def all_heartbeats(self) -> str:
        return f"{self.namespace}.engine.*.heartbeat"

    def completed(self) -> str:
        return f"{self.namespace}.hook.completed"

    def intent(self) -> str:
        return f"{self.namespace}.hook.intent"

    def all_rounds(self) -> str:
        return f"{self.namespace}.engine.*.round"

    def all_switches(self) -> str:
        return f"{self.namespace}.engine.*.switch"

    def router_calls(self, router: str) -> str:
        return f"{self.namespace}.router.{check_token(router, 'router id')}.calls"

    def all_router_calls(self) -> str:
        return f"{self.namespace}.router.*.calls"

    def kvstore_stats(self, store: str) -> str:
        return f"{self.namespace}.kvstore.{check_token(store, 'store id')}.stats"

    def all_kvstore_stats(self) -> str:
        return f"{self.namespace}.kvstore.*.stats"

    def inbox_prefix(self, router: str) -> str:
        return f"{self.namespace}.inbox.{check_token(router, 'router id')}"

    def lease_bucket(self) -> str:
        return f"{self.namespace}_{LEASE_BUCKET}"

    def responses_bucket(self) -> str:
        """The JetStream KV bucket of stored Responses."""
        return f"{self.namespace}_responses"

    @staticmethod
    def instance_of(subject: str) -> str:
        """Instance id of an engine subject (``<ns>.engine.<instance>.<endpoint>``)."""
        parts = subject.split(".")
        if len(parts) != 4 or parts[1] != "engine":
            raise ValueError(f"not an engine subject: {subject!r}")
        return parts[2]
