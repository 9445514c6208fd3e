#!/usr/bin/env python3
# A test ACECode channel platform plugin, written from ACECode's plugin protocol document
# alone (stdio JSONL: requests with id/method/params, responses with id/ok/result|error,
# notifications, events), not from channeld's code.
#
# It records every line it receives, and each start (argv, cwd, reason), as JSON lines in
# $FAKE_PLUGIN_LOG. It emits an `inbound` event for each *.json file that appears in
# $FAKE_PLUGIN_INBOX (the file holds the event's params; it is deleted once sent).
#
# Modes (environment):
#   FAKE_PLUGIN_MALFORMED=N    on the first N starts, write a line that is not a JSON object
#                              right after answering initialize (the host must restart it)
#   FAKE_PLUGIN_LOGIN_REQUIRED=1
#                              on a start with reason "auto", report login_required and exit;
#                              with reason "user" (after an operator's resume), connect
#   FAKE_PLUGIN_SLOW_SECONDS=S send_text whose text starts with "slow" answers after S s
#   FAKE_PLUGIN_SLOW_INIT_SECONDS=S
#                              initialize answers after S s
#   FAKE_PLUGIN_MAX_TEXT_UNITS, FAKE_PLUGIN_COUNT_UTF16=1, FAKE_PLUGIN_TYPING=0
#                              the capabilities it announces (defaults 4000, false, true)
# Outcomes by text: "hold…" → held, "fail…" → failed, anything else → sent.

import json
import os
import sys
import threading
import time

LOG = os.environ.get("FAKE_PLUGIN_LOG")
INBOX = os.environ.get("FAKE_PLUGIN_INBOX")
ACCOUNT = os.environ.get("FAKE_PLUGIN_ACCOUNT", "me")
lock = threading.Lock()


def record(entry):
    if LOG:
        with lock, open(LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def write(obj):
    line = json.dumps(obj, ensure_ascii=False)
    with lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def write_raw(text):
    with lock:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def status(state, detail="", login_required=False, retry_stopped=False):
    write({"event": "status", "params": {
        "state": state, "detail": detail, "retry_stopped": retry_stopped,
        "account": ACCOUNT, "display_name": "Me Myself",
        "extra": {"login_required": login_required},
    }})


def count_starts():
    if not LOG or not os.path.exists(LOG):
        return 0
    with open(LOG, encoding="utf-8") as f:
        return sum(1 for line in f if json.loads(line).get("start"))


def watch_inbox():
    while True:
        time.sleep(0.05)
        if not INBOX or not os.path.isdir(INBOX):
            continue
        for name in sorted(os.listdir(INBOX)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(INBOX, name)
            with open(path, encoding="utf-8") as f:
                params = json.load(f)
            os.remove(path)
            write({"event": "inbound", "params": params})


def answer_send(req):
    text = req["params"].get("text", "")
    if text.startswith("slow"):
        time.sleep(float(os.environ.get("FAKE_PLUGIN_SLOW_SECONDS", "5")))
    if text.startswith("hold"):
        result = {"outcome": "held"}
    elif text.startswith("fail"):
        result = {"outcome": "failed", "error": "the fake platform refused it"}
    else:
        result = {"outcome": "sent"}
    write({"id": req["id"], "ok": True, "result": result})


def main():
    starts = count_starts()
    malformed_starts = int(os.environ.get("FAKE_PLUGIN_MALFORMED", "0"))
    for raw in sys.stdin:
        raw = raw.strip()
        if not raw:
            continue
        msg = json.loads(raw)
        record({"received": msg})
        method = msg.get("method")
        if "id" not in msg:
            continue  # a notification (set_typing): no response
        rid = msg["id"]
        if method == "initialize":
            params = msg["params"]
            record({"start": True, "argv": sys.argv[1:], "cwd": os.getcwd(),
                    "reason": params.get("reason"), "platform": params.get("platform"),
                    "settings": params.get("settings")})
            time.sleep(float(os.environ.get("FAKE_PLUGIN_SLOW_INIT_SECONDS", "0")))
            if params.get("protocol_version") != 1:
                write({"id": rid, "ok": False, "error": "unsupported protocol version"})
                continue
            caps = {
                "max_text_units": int(os.environ.get("FAKE_PLUGIN_MAX_TEXT_UNITS", "4000")),
                "count_utf16": os.environ.get("FAKE_PLUGIN_COUNT_UTF16") == "1",
                "supports_typing": os.environ.get("FAKE_PLUGIN_TYPING", "1") == "1",
            }
            write({"id": rid, "ok": True,
                   "result": {"protocol_version": 1, "capabilities": caps}})
            if starts < malformed_starts:
                write_raw("this line is not a JSON object")
                continue
            if os.environ.get("FAKE_PLUGIN_LOGIN_REQUIRED") == "1" and params.get("reason") != "user":
                status("failed", "another client took over the account",
                       login_required=True, retry_stopped=True)
                sys.stdout.flush()
                return 1
            status("connecting")
            status("connected")
            threading.Thread(target=watch_inbox, daemon=True).start()
        elif method == "send_text":
            threading.Thread(target=answer_send, args=(msg,), daemon=True).start()
        elif method == "action":
            if msg["params"].get("name") == "login":
                write({"id": rid, "ok": True, "result": {"login": "started"}})
                status("connected", "signed in again")
            else:
                write({"id": rid, "ok": False, "error": "unknown action"})
        elif method == "configure":
            write({"id": rid, "ok": True, "result": {}})
        elif method == "shutdown":
            write({"id": rid, "ok": True, "result": {}})
            status("stopped")
        else:
            write({"id": rid, "ok": False, "error": "unsupported method " + str(method)})
    record({"stdin_closed": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
