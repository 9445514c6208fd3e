#!/usr/bin/env python3
# A complete channeld driver in Python, written from PROTOCOL.md alone, that
# channeld-conformance must pass. Its "platform" is a drop directory: each
# *.txt file in CHANNELD_PYDROP_INBOX is a message (file name = message id),
# removed once the hub took it; each post is a line appended to
# CHANNELD_PYDROP_OUTBOX. No dependencies beyond the standard library.
#
# faulty_driver.py subclasses Driver to break it in known ways.

import json
import os
import random
import select
import signal
import socket
import sys
import time

ABI = "cortexfs.channel.socket/v1"
MAX_LINE = 262144  # bytes, newline included
HEARTBEAT_SECONDS = 15
KNOWN_TYPES = {
    "hello", "control_hello", "start", "stop", "inbound", "inbound_event", "deliver",
    "outbound", "receipt", "effect", "command", "command_result", "control_request",
    "control_response", "health_request", "health_response", "health", "event", "error",
    "hello_ack", "accepted", "operator_action", "operator_action_result",
}


def log(message):
    print(f"pydrop: {message}", file=sys.stderr, flush=True)


def setting(name, alias=None):
    value = os.environ.get(name) or (os.environ.get(alias) if alias else None)
    if not value:
        log(f"{name} is not set")
        sys.exit(78)
    return value


class Lost(Exception):
    """The hub connection ended; reconnect."""


class Driver:
    def __init__(self):
        self.channel = setting("CHANNELD_CHANNEL_ID", "CORTEXFS_CHANNEL_ID")
        self.socket_path = setting("CHANNELD_SOCKET", "CORTEXFS_CHANNEL_SOCKET")
        self.inbox = setting("CHANNELD_PYDROP_INBOX")
        self.outbox = setting("CHANNELD_PYDROP_OUTBOX")
        self.stopping = False
        self.reported = {}  # event id -> inbound frame the hub has not taken yet
        self.posted = {}  # ("deliver"|"outbound", request id) -> receipt
        self.posts = 0
        self.negotiated = set()
        self.sock = None
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_sigterm(self, _signum, _frame):
        self.stopping = True

    # --- the connection loop -------------------------------------------------------------

    def backoff_delays(self):
        """1 s doubling to 30 s, each with +-25 % jitter."""
        base = 1.0
        while True:
            yield base * random.uniform(0.75, 1.25)
            base = min(base * 2, 30.0)

    def run(self):
        delays = self.backoff_delays()
        while not self.stopping:
            up = None
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(self.socket_path)
                up = time.monotonic()
                if self.session() == "stopped":
                    return 0
            except (OSError, Lost) as err:
                log(f"hub connection lost ({err.__class__.__name__}), reconnecting")
            finally:
                self.sock.close()
            if up is not None and time.monotonic() - up >= 60:
                delays = self.backoff_delays()
            deadline = time.monotonic() + next(delays)
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(0.02)
        return 0

    def send(self, frame):
        self.sock.sendall((json.dumps({"abi": ABI, "frame": frame}) + "\n").encode())

    def session(self):
        self.negotiated = set()
        self.send({
            "type": "hello",
            "request_id": f"{self.channel}-hello",
            "channel": self.channel,
            "capabilities": {"receive": True, "send": True},
            "extensions": ["accepted", "reply_receipt"],
        })
        self.send({"type": "start", "request_id": f"{self.channel}-start"})
        for frame in list(self.reported.values()):
            self.send(frame)  # unanswered before the reconnect: resend, same event id
        buffer, skipping = b"", False
        next_poll, next_heartbeat = 0.0, time.monotonic() + HEARTBEAT_SECONDS
        while True:
            if self.stopping:
                self.send({"type": "stop", "request_id": f"{self.channel}-stop"})
                return "stopped"
            now = time.monotonic()
            if now >= next_poll:
                self.poll_inbox()
                next_poll = now + 0.05
            if now >= next_heartbeat:
                self.send({"type": "event", "event": {"type": "heartbeat"}})
                next_heartbeat = now + HEARTBEAT_SECONDS
            try:
                readable, _, _ = select.select([self.sock], [], [], 0.05)
            except InterruptedError:
                continue
            if not readable:
                continue
            chunk = self.sock.recv(65536)
            if not chunk:
                raise Lost("hub closed the connection")
            buffer += chunk
            while True:
                end = buffer.find(b"\n")
                if end < 0:
                    if len(buffer) >= MAX_LINE:
                        if not skipping:
                            self.error(None, "line_too_long", "line exceeds the limit")
                        buffer, skipping = b"", True
                    break
                line, buffer = buffer[:end], buffer[end + 1:]
                if skipping:
                    skipping = False  # the end of an oversize line
                elif len(line) + 1 > MAX_LINE:
                    self.error(None, "line_too_long", "line exceeds the limit")
                elif line.strip():
                    self.handle_line(line)

    # --- the hub's frames ----------------------------------------------------------------

    def error(self, request_id, code, message, retryable=False):
        self.send({"type": "error", "request_id": request_id, "code": code,
                   "message": message, "retryable": retryable})

    def handle_line(self, line):
        try:
            envelope = json.loads(line)
        except ValueError:
            return self.error(None, "invalid_json", "line is not valid JSON")
        if not isinstance(envelope, dict):
            return self.error(None, "invalid_frame", "line is not a JSON object")
        if envelope.get("abi") != ABI:
            return self.error(None, "unsupported_abi", "unsupported abi")
        frame = envelope.get("frame")
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            return self.error(None, "invalid_frame", "frame has no type")
        kind = frame["type"]
        if kind not in KNOWN_TYPES:
            return self.error(None, "unknown_frame_type", f"unknown frame type {kind}")
        handler = getattr(self, f"on_{kind}", None)
        if handler is not None:
            handler(frame)

    def on_hello_ack(self, frame):
        self.negotiated = set(frame.get("extensions", []))

    def on_accepted(self, frame):
        self.settle(frame["event_id"])

    def on_deliver(self, frame):
        receipt = self.post(("deliver", frame["request_id"]), frame["message"])
        self.settle(frame["request_id"])  # a reference hub's deliver is its acceptance
        if "reply_receipt" in self.negotiated:
            self.send({"type": "receipt", "request_id": frame["request_id"], "receipt": receipt})

    def on_outbound(self, frame):
        receipt = self.post(("outbound", frame["request_id"]), frame["message"])
        self.send({"type": "receipt", "request_id": frame["request_id"], "receipt": receipt})

    def on_health_request(self, frame):
        self.send({"type": "health_response", "request_id": frame["request_id"],
                   "health": {"state": "Ready", "detail": "watching the drop directory"}})

    def on_effect(self, frame):
        self.error(frame["request_id"], "unsupported_effect", "this driver declares no actions")

    def on_command(self, frame):
        self.send({"type": "command_result", "request_id": frame["request_id"],
                   "session": frame["session"], "command_id": frame["command_id"],
                   "result": {"type": "rejected", "reason": "no interactive surface"}})

    def on_operator_action(self, frame):
        self.send({"type": "operator_action_result", "request_id": frame["request_id"],
                   "ok": False, "code": "unsupported", "message": "no operator actions"})

    def on_error(self, frame):
        log(f"the hub reported {frame.get('code')}")

    def on_stop(self, _frame):
        raise Lost("the hub is stopping")

    # --- the platform --------------------------------------------------------------------

    def poll_inbox(self):
        for name in sorted(os.listdir(self.inbox)):
            event_id = name[:-len(".txt")]
            if not name.endswith(".txt") or event_id in self.reported:
                continue
            with open(os.path.join(self.inbox, name), encoding="utf-8") as file:
                text = file.read()
            frame = {"type": "inbound", "event_id": event_id, "message": {
                "id": event_id,
                "target": {"channel": self.channel, "conversation": "drop"},
                "sender": {"id": "dropper"},
                "body": {"text": text},
            }}
            self.reported[event_id] = frame
            self.send(frame)

    def settle(self, event_id):
        if self.reported.pop(event_id, None) is not None:
            try:
                os.remove(os.path.join(self.inbox, f"{event_id}.txt"))
            except FileNotFoundError:
                pass

    def post(self, key, message):
        """Posts once per request: a repeated request gets the first receipt."""
        if key not in self.posted:
            self.posts += 1
            with open(self.outbox, "a", encoding="utf-8") as file:
                file.write(message["body"].get("text", "") + "\n")
            self.posted[key] = {
                "channel": self.channel,
                "message_id": f"py-{os.getpid()}-{self.posts}",
                "target": message["target"],
                "timestamp_ms": int(time.time() * 1000),
            }
        return self.posted[key]


if __name__ == "__main__":
    sys.exit(Driver().run())
