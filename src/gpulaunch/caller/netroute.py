"""Which local address and interface reach a given host: what a multi-node node listens on, and
what ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name.

Listening on 0.0.0.0 would expose the rendezvous store on every interface (public ones too),
and letting gloo/NCCL pick an interface is the classic cause of ``init_process_group`` hanging
over the wrong network (docker0, a VPN, 127.0.1.1 from /etc/hosts). The route the kernel takes
to the master is the one that works, so we ask the kernel: a UDP ``connect`` sends nothing, it
only selects the route and the source address.
"""

from __future__ import annotations

import ipaddress
import socket

from ..errors import ConfigurationError


def resolve(host: str) -> str:
    """``host`` as an IP address (the first one the resolver gives)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ConfigurationError(f"master address {host!r} does not resolve ({e}); give node "
                                 "0's IP address or a host name every node can resolve") from None


def local_ip_towards(host: str, port: int = 9) -> str:
    """The source address this host uses to reach ``host``."""
    ip = resolve(host)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as e:
            raise ConfigurationError(f"no route from this host to the master {host} ({ip}): "
                                     f"{e}") from None
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """The network interface holding ``ip`` (None when it cannot be told)."""
    if ipaddress.ip_address(ip).is_loopback:
        return "lo" if _has_interface("lo") else None
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return None


def _has_interface(name: str) -> bool:
    try:
        return any(n == name for _, n in socket.if_nameindex())
    except OSError:
        return False
