"""An object-store benchmark endpoint made of real parts: nginx in a network namespace behind a
link with latency and a per-connection rate, serving a folder as a path-style S3 endpoint.

    with NetnsStore(root) as store:          # root/BUCKET/KEY is s3://BUCKET/KEY
        store.endpoint                       # http://10.213.N.2:9000 (AWS_ENDPOINT_URL)
        store.url("bench/big.safetensors")   # the same object over plain HTTP

What it builds (needs root for ``ip netns``, ``ip link`` and ``tc``; :class:`StoreUnavailable`
with a one-line reason otherwise, which a benchmark prints as its reason to skip):

* a network namespace and a veth pair between it and this one, addressed on a private /30
  (``10.213.N.0/30``, N from the process id): a link inside the machine, nothing leaves it;
* a round trip of ``2 * delay_ms`` (15 ms each way by default): ``tc ... netem delay`` on the link
  where the kernel has netem; where it has not (``CONFIG_NET_SCH_NETEM`` off, as on some VM
  kernels), nginx waits the whole round trip before answering each request instead
  (``echo_sleep``, nginx's echo module), which keeps an object store's time to first byte but
  not the slower start of a fresh connection: :attr:`NetnsStore.delay_on_link` says which;
* a rate of ``rate`` bytes per second (200 MB/s) per connection, an object store's profile where
  parallel connections add up and one stream does not: an HTB class per connection on the
  store's side of the link, chosen by a hash of the client's port (256 classes; consecutive
  ephemeral ports land in distinct ones). nginx's own ``limit_rate`` is not used: it counts in
  whole seconds and lets the first second's worth of every answer (200 MB) through unthrottled;
* nginx inside the namespace (``ip netns exec``), serving ``root`` path-style: ``GET``/``HEAD
  /BUCKET/KEY`` with ``Range``, ``ETag``, ``If-Match``. It ignores the SigV4 ``Authorization``
  header, so any credentials are accepted; there is no ListObjects. With ``access_log=True`` it
  logs each answer's client and body bytes (:meth:`NetnsStore.served`).

Other benchmarks build on it: :func:`run_tool` runs ``ip``/``tc``, :meth:`NetnsStore.inside`
runs a command in the store's namespace (to add links of its own to it), :func:`rate_limit`
shapes a whole link.

Everything is removed on exit (nginx stopped, the namespace and the veth pair deleted), also
after an error. Run by hand to try it (``curl`` the endpoint it prints; Ctrl-D stops it)::

    sudo python benchmarks/netns_store.py ROOT [--delay-ms 15] [--rate 200e6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

PORT = 9000
DELAY_MS = 15.0
RATE = 200_000_000  # bytes per second per connection
CLASSES = 256  # per-connection rate classes, chosen by the client's port
ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")


class StoreUnavailable(RuntimeError):
    """The endpoint cannot be built here (not root, a tool missing): the reason, one line."""


def run_tool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``ip``, ``tc`` or the like; :class:`StoreUnavailable` with its error if it fails."""
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode:
        raise StoreUnavailable(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def check_available() -> None:
    """Raise :class:`StoreUnavailable` unless this process can build the endpoint."""
    if os.geteuid() != 0:
        raise StoreUnavailable(
            "the netns object-store endpoint needs root (ip netns, veth, tc): run the benchmark "
            "as root to include it"
        )
    missing = [tool for tool in ("ip", "tc", "nginx") if shutil.which(tool) is None]
    if missing:
        raise StoreUnavailable(f"the netns object-store endpoint needs {', '.join(missing)}")


def _rate_classes(device: str, rate: int) -> str:
    """``tc -batch`` lines: on ``device``'s egress, one HTB class of ``rate`` bytes/s per hash
    bucket of the TCP destination port (the client's port, seen from the store)."""
    bits = rate * 8
    lines = [
        f"qdisc add dev {device} root handle 1: htb default 1 r2q 1000",
        f"class add dev {device} parent 1: classid 1:1 htb rate 100gbit",
        f"filter add dev {device} parent 1: prio 1 handle 2: protocol ip u32 divisor {CLASSES}",
        # Bits 1-8 of the destination port (at 20 past an IP header with no options; the word
        # there is source port, destination port): Linux hands out ephemeral ports 2 apart.
        f"filter add dev {device} parent 1: prio 1 protocol ip u32 ht 800:: "
        "match ip protocol 6 0xff hashkey mask 0x000001fe at 20 link 2:",
    ]
    for bucket in range(CLASSES):
        leaf = f"1:{bucket + 16:x}"
        lines.append(
            f"class add dev {device} parent 1:1 classid {leaf} htb rate {bits}bit "
            "burst 512k cburst 512k quantum 200000"
        )
        lines.append(
            f"filter add dev {device} parent 1: prio 1 protocol ip u32 ht 2:{bucket:x}: "
            f"match u32 0 0 flowid {leaf}"
        )
    return "\n".join(lines) + "\n"


def rate_limit(device: str, rate: int) -> str:
    """``tc -batch`` lines: ``device``'s egress limited to ``rate`` bytes/s in all (one HTB
    class: a link's rate, whatever the connections on it)."""
    return (
        f"qdisc add dev {device} root handle 1: htb default 1 r2q 1000\n"
        f"class add dev {device} parent 1: classid 1:1 htb rate {rate * 8}bit "
        "burst 512k cburst 512k quantum 200000\n"
    )


class NetnsStore:
    """nginx serving ``root`` path-style in a namespace behind a shaped link (see the module)."""

    def __init__(
        self,
        root: Path,
        *,
        delay_ms: float = DELAY_MS,
        rate: int = RATE,
        port: int = PORT,
        access_log: bool = False,
    ) -> None:
        self.root = Path(root).resolve()
        self.access_log = access_log
        self.delay_ms = delay_ms
        self.rate = rate
        self.port = port
        pid = os.getpid()
        self.namespace = f"stst-store-{pid}"
        self._outer, self._inner = f"stso{pid}"[:15], f"stsi{pid}"[:15]
        self.host_address = f"10.213.{pid % 250 + 1}.1"
        self.store_address = f"10.213.{pid % 250 + 1}.2"
        self.delay_on_link = False
        self._folder: Path | None = None
        self._nginx: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The endpoint URL, as ``AWS_ENDPOINT_URL`` or an ``S3Config`` endpoint takes it."""
        return f"http://{self.store_address}:{self.port}"

    def url(self, key: str) -> str:
        """The plain HTTP URL of ``key`` (``BUCKET/NAME``) on the endpoint."""
        return f"{self.endpoint}/{key}"

    def describe(self) -> str:
        """One line: what the link does."""
        where = "netem on the link" if self.delay_on_link else "nginx echo_sleep per request"
        return (
            f"{self.endpoint}: round trip {2 * self.delay_ms:g} ms ({where}), "
            f"{self.rate / 1e6:g} MB/s per connection (HTB per client port)"
        )

    def __enter__(self) -> NetnsStore:
        check_available()
        try:
            self._link()
            self._serve()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def inside(self, *args: str) -> tuple[str, ...]:
        """``args`` as a command run inside the store's namespace."""
        return ("ip", "netns", "exec", self.namespace, *args)

    def _link(self) -> None:
        """The namespace, the veth pair between it and here, addresses, delay and rate."""
        run_tool("ip", "netns", "add", self.namespace)
        run_tool("ip", "link", "add", self._outer, "type", "veth", "peer", "name", self._inner)
        run_tool("ip", "link", "set", self._inner, "netns", self.namespace)
        run_tool("ip", "addr", "add", f"{self.host_address}/30", "dev", self._outer)
        run_tool("ip", "link", "set", self._outer, "up")
        run_tool(*self.inside("ip", "addr", "add", f"{self.store_address}/30", "dev", self._inner))
        run_tool(*self.inside("ip", "link", "set", self._inner, "up"))
        run_tool(*self.inside("ip", "link", "set", "lo", "up"))
        run_tool(*self.inside("tc", "-batch", "-"), stdin=_rate_classes(self._inner, self.rate))
        # The store's side carries the rate classes, so the whole round trip is added on this
        # side (requests and acknowledgements); a deep queue holds what 16 fast streams send.
        delay = f"{2 * self.delay_ms:g}ms"
        netem = subprocess.run(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                self._outer,
                "root",
                "netem",
                "delay",
                delay,
                "limit",
                "1000000",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        self.delay_on_link = netem.returncode == 0
        if not self.delay_on_link and not ECHO_MODULE.exists():
            raise StoreUnavailable(
                f"no netem in this kernel ({netem.stderr.strip()}) and no nginx echo module "
                f"({ECHO_MODULE}) to add the delay instead"
            )

    def _serve(self) -> None:
        """nginx inside the namespace; returns once it answers."""
        folder = self._folder = Path(tempfile.mkdtemp(prefix="netns-store-"))
        temp = "\n".join(
            f'{kind}_temp_path "{folder / kind}";'
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        if self.delay_on_link:
            module, serve = "", "location / { }"
        else:
            module = f'load_module "{ECHO_MODULE}";'
            serve = f"location / {{ echo_sleep {2 * self.delay_ms / 1000:g}; echo_exec @object; }}"
            serve += "\n        location @object { }"
        logging = "access_log off;"
        if self.access_log:
            logging = "log_format served '$remote_addr $body_bytes_sent';\n"
            logging += f'    access_log "{folder / "access.log"}" served;'
        (folder / "nginx.conf").write_text(f"""
{module}
user root;
worker_processes 2;
pid "{folder / "nginx.pid"}";
error_log "{folder / "error.log"}" warn;
events {{ worker_connections 1024; }}
http {{
    {temp}
    {logging}
    sendfile on;
    keepalive_requests 100000;
    default_type application/octet-stream;
    server {{
        listen {self.store_address}:{self.port};
        root "{self.root}";
        {serve}
    }}
}}
""")
        config = str(folder / "nginx.conf")
        self._nginx = subprocess.Popen(
            self.inside("nginx", "-p", str(folder), "-c", config, "-g", "daemon off;")
        )
        give_up = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1) as answer:
                    answer.read()
                return
            except urllib.error.HTTPError:
                return  # nginx answers (403 or 404 for the folder itself): it is up
            except OSError as exc:
                if self._nginx.poll() is not None or time.monotonic() > give_up:
                    log = folder / "error.log"
                    said = log.read_text().strip() if log.exists() else ""
                    raise StoreUnavailable(f"nginx did not start in the namespace: {said}") from exc
                time.sleep(0.05)

    def served(self) -> list[tuple[str, int]]:
        """Each answer so far, in order: the client's address and the body bytes sent (with
        ``access_log=True``; nginx writes a line as each answer ends)."""
        if not self.access_log or self._folder is None:
            raise StoreUnavailable("the store keeps no access log: give access_log=True")
        path = self._folder / "access.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(client, int(sent)) for client, sent in (line.split() for line in lines)]

    def close(self) -> None:
        """Stop nginx, delete the namespace and the veth pair."""
        if self._nginx is not None:
            self._nginx.terminate()
            try:
                self._nginx.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._nginx.kill()
                self._nginx.wait()
            self._nginx = None
        subprocess.run(["ip", "link", "del", self._outer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="an object-store endpoint behind a shaped link")
    parser.add_argument("root", type=Path, help="the folder served: ROOT/BUCKET/KEY")
    parser.add_argument("--delay-ms", type=float, default=DELAY_MS, help="added each way")
    parser.add_argument("--rate", type=float, default=RATE, help="bytes/s per connection")
    args = parser.parse_args(argv)
    try:
        with NetnsStore(args.root, delay_ms=args.delay_ms, rate=int(args.rate)) as store:
            print(store.describe(), "(Ctrl-D to stop)", flush=True)
            sys.stdin.read()
    except StoreUnavailable as exc:
        sys.exit(f"skipped: {exc}")


if __name__ == "__main__":
    main()
