"""Plain TCP throughput between two processes: ``serve PORT`` / ``send ADDR PORT MBYTES``.

Started by ``bench/cluster.py`` inside the namespaced hosts for the link calibration. The
sender prints one JSON line: bytes sent, seconds, MB/s (the receiver has read everything
when the sender's close returns, because the receiver answers with one byte at the end).
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                while conn.recv(CHUNK):
                    pass
                # unreachable for a well-behaved sender: it waits for our answer before closing


def serve_once(port: int, ready_file: str | None = None) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        if ready_file:
            open(ready_file, "w").close()
        conn, _ = server.accept()
        with conn:
            header = conn.recv(16)
            total = int(header.decode().strip())
            got = 0
            while got < total:
                data = conn.recv(min(CHUNK, total - got))
                if not data:
                    break
                got += len(data)
            conn.sendall(b"k")


def send(addr: str, port: int, mbytes: float) -> None:
    total = int(mbytes * 1e6)
    payload = b"\0" * CHUNK
    with socket.create_connection((addr, port), timeout=60) as conn:
        conn.sendall(f"{total:<16d}".encode())
        t0 = time.perf_counter()
        left = total
        while left > 0:
            n = min(left, CHUNK)
            conn.sendall(payload[:n])
            left -= n
        conn.recv(1)
        seconds = time.perf_counter() - t0
    print(json.dumps({"bytes": total, "seconds": seconds, "MBps": total / seconds / 1e6}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve_once(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
