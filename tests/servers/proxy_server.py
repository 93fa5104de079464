"""tinyproxy from the system as a forward proxy on 127.0.0.1: absolute-URI requests for
``http://`` and ``CONNECT host:port`` tunnels (for ``https://``) to any port.

    with ForwardProxy(folder) as proxy:     # or: the forward_proxy fixture
        proxy.url                           # http://127.0.0.1:PORT, as for HTTP_PROXY
        proxy.log()                         # tinyproxy's log: the requests and tunnels it made

Its configuration, pid file and log are in ``folder``; it serves loopback clients only.
"""

from __future__ import annotations

from .daemon import Daemon


class ForwardProxy(Daemon):
    """tinyproxy run in the foreground (see the module)."""

    program = "tinyproxy"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configure(self, ports: list[int]) -> list[str]:
        folder = self.folder
        # No ConnectPort line: CONNECT may reach every port (tinyproxy's default is 443, 563).
        (folder / "tinyproxy.conf").write_text(f"""
Port {ports[0]}
Listen 127.0.0.1
Allow 127.0.0.1
Timeout 30
MaxClients 64
DisableViaHeader Yes
LogLevel Info
LogFile "{folder / "tinyproxy.log"}"
PidFile "{folder / "tinyproxy.pid"}"
""")
        return ["-d", "-c", str(folder / "tinyproxy.conf")]

    def log(self) -> str:
        """What tinyproxy logged so far."""
        return (self.folder / "tinyproxy.log").read_text(errors="replace")
