"""Optional poller of a cloud's spot-interruption notice endpoint (off by default).

AWS answers `GET /latest/meta-data/spot/instance-action` with 200 and a JSON body once the
instance is marked for interruption (about two minutes ahead) and 404 before; GCP's
`/computeMetadata/v1/instance/preempted` answers "TRUE". Either way the poller asks the loop to
stop, which writes an emergency checkpoint. Set `train.checkpoint.spot_notice_url` to enable it; GCP needs
the `Metadata-Flavor: Google` header, which is always sent.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from typing import Protocol

__all__ = ["start_spot_notice_poller", "notice_present"]

log = logging.getLogger(__name__)


class _Stoppable(Protocol):
    def request(self, reason: str) -> None: ...


def notice_present(url: str, timeout: float = 2.0) -> bool:
    req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})  # noqa: S310 - URL is user config
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - URL is user config
            body = resp.read(4096).decode(errors="replace").strip()
            return resp.status == 200 and body.upper() != "FALSE"
    except urllib.error.HTTPError:
        return False  # 404: no notice yet
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


def start_spot_notice_poller(url: str, interval: float, stop: _Stoppable) -> threading.Thread:
    done = threading.Event()

    def poll() -> None:
        while not done.wait(interval):
            if notice_present(url):
                log.warning("spot interruption notice at %s: checkpointing and exiting", url)
                stop.request(f"spot interruption notice from {url}")
                return

    thread = threading.Thread(target=poll, name="spot-notice-poller", daemon=True)
    thread.start()
    return thread
