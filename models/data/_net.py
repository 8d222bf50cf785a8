"""Whether a download host answers, asked without blocking longer than a timeout."""

import socket
import threading


def host_reachable(address: tuple[str, int], timeout: float = 5.0) -> bool:
    """Can we open a TCP connection to ``address`` within ``timeout`` seconds (name lookup
    included: it runs in a thread, since the lookup inside ``create_connection`` ignores the
    timeout)?"""
    answered = []

    def probe():
        try:
            with socket.create_connection(address, timeout=timeout):
                answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)
