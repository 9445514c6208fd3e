#!/usr/bin/env python3
# good_driver.py with four deliberate faults, each of which channeld-conformance must
# catch in the check named beside it (and nowhere else):
#   - logs its whole environment at start-up, secrets included   -> secret
#   - never answers an outbound (no receipt, no error)            -> outbound, reference_hub
#   - crashes on an error frame from the hub                      -> error_frame
#   - reconnects after a fixed 0.2 s, no backoff                  -> reconnect

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from good_driver import Driver, log  # noqa: E402


class FaultyDriver(Driver):
    def __init__(self):
        log(f"starting with {dict(os.environ)}")
        super().__init__()

    def on_outbound(self, frame):
        pass

    def on_error(self, frame):
        raise RuntimeError(f"cannot handle an error frame: {frame}")

    def backoff_delays(self):
        while True:
            yield 0.2


if __name__ == "__main__":
    sys.exit(FaultyDriver().run())
