"""A trivial TCP echo server: the baseline a card link is compared against.

``python -m exstill_sdk.bench.link.echo REQUEST_BYTES REPLY_BYTES`` prints its port, then answers
every REQUEST_BYTES received with REPLY_BYTES bytes, on a blocking socket, one client at a time.
"""

from __future__ import annotations

import socket
import sys


def serve(request_bytes: int, reply_bytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    reply = b"\x01" * reply_bytes
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = 0
        while True:
            data = conn.recv(65536)
            if not data:
                break
            got += len(data)
            while got >= request_bytes:
                got -= request_bytes
                conn.sendall(reply)
        conn.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
