"""The TCP sockets a set of processes listens on, read from ``/proc`` (Linux), and whether
each speaks HTTP/1 (a plain GET gets an ``HTTP/`` status line back)."""

from __future__ import annotations

import ipaddress
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

LISTEN = "0A"


class Listener(NamedTuple):
    pid: int
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.host)
        mapped = getattr(address, "ipv4_mapped", None)   # ::ffff:127.0.0.1
        return (mapped or address).is_loopback


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) a process of ``pids`` holds."""
    sockets = _listening_inodes()
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in sockets:
                host, port = sockets[target[8:-1]]
                out.append(Listener(pid, host, port))
    return sorted(set(out), key=lambda s: (s.port, s.host, s.pid))


def speaks_http(listener: Listener, timeout_s: float = 3.0) -> bool:
    """A GET gets an HTTP/1 status line back (gRPC's HTTP/2 servers do not); sent to the
    address the socket is bound to (loopback for a wildcard)."""
    host = listener.host
    if ipaddress.ip_address(host).is_unspecified:
        host = "127.0.0.1" if ipaddress.ip_address(host).version == 4 else "::1"
    try:
        with socket.create_connection((host, listener.port), timeout=timeout_s) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return s.recv(16).startswith(b"HTTP/")
    except OSError:   # refused, reset or silent until the timeout
        return False


def http_listeners(pids: set[int]) -> list[Listener]:
    """The listening sockets of ``pids`` that answer HTTP/1 (probed all at once)."""
    found = listeners(pids)
    with ThreadPoolExecutor(max(1, len(found))) as pool:
        return [s for s, http in zip(found, pool.map(speaks_http, found)) if http]


def _listening_inodes() -> dict[str, tuple[str, int]]:
    out = {}
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == LISTEN:
                    hexhost, hexport = cols[1].split(":")
                    out[cols[9]] = (_address(bytes.fromhex(hexhost), size), int(hexport, 16))
    return out


def _address(raw: bytes, size: int) -> str:
    # NOTE: /proc prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
    return str(ipaddress.ip_address(words))
