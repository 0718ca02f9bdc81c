"""The environment of a machine whose processes' gloo would listen on its network interface by default.

gloo binds the address its host name resolves to; on the test machine that may be 127.0.0.1 already, which
would hide a listener that follows gloo's default. GLOO_SOCKET_IFNAME set to the default route's interface
makes that default a network one, as on a node whose host name resolves to its NIC; qual must override it.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_route_interface() -> str | None:
    """The interface of the IPv4 default route (from /proc/net/route), if any."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        if len(cols) > 2 and cols[1] == "00000000" and cols[0] != "lo":
            return cols[0]
    return None


def nic_env() -> dict[str, str]:
    env = dict(os.environ)
    nic = default_route_interface()
    if nic:
        env["GLOO_SOCKET_IFNAME"] = nic
    return env
