"""Which network interface and address this node uses to reach the other nodes.

Across machines, every process advertises an address that the others connect back to: the
elastic agent its rendezvous address (local_addr; rank 0's also becomes MASTER_ADDR), gloo and NCCL
the address of their socket interface. Left alone, they take the hostname's address, often
127.0.1.1 or a management network that the other nodes cannot reach, and the job fails or hangs
("wrong interface" is the most common NCCL complaint). So partrain asks the kernel which interface
routes to the rendezvous endpoint, uses that interface's address, and sets GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME to it unless the user set them. `--local-addr` and `--ifname` override it.
"""

import fcntl
import ipaddress
import os
import socket
import struct
import time
from dataclasses import dataclass

from partrain.errors import ConfigError

SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class NodeNetwork:
    """This node's interface and address, and how they were found (printed for the user)."""

    ifname: str | None
    addr: str
    how: str


def split_endpoint(endpoint: str, source: str = "--rdzv-endpoint") -> tuple[str, int]:
    """HOST:PORT (IPv6 as [ADDR]:PORT) -> (host, port), or a ConfigError naming where the
    endpoint came from (the flag, or the SLURM job)."""
    host, sep, port = endpoint.rpartition(":")
    bracketed = host.startswith("[") or host.endswith("]")
    if bracketed and not (host.startswith("[") and host.endswith("]")):
        host = ""  # `[::1:29500`: an IPv6 address half in brackets
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{source} {endpoint} must be HOST:PORT with a port in 1..65535 "
                          "(node 0's address and a free port, the same on every node)")
    return host, int(port)


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses() -> dict[str, str]:
    """address -> interface, from /proc/net/if_inet6 (the kernel's own table)."""
    table = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                table[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[-1]
    except OSError:
        pass
    return table


def interface_of(addr: str) -> str | None:
    """The interface that holds a local address, or None if no interface does."""
    if ipaddress.ip_address(addr).version == 6:
        return _ipv6_addresses().get(str(ipaddress.ip_address(addr)))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == addr:
            return name
    return None


def address_of(ifname: str) -> str | None:
    """An interface's IPv4 address (else its first IPv6 one), or None if it has none."""
    v4 = _ipv4_of(ifname)
    if v4:
        return v4
    return next((a for a, name in _ipv6_addresses().items() if name == ifname), None)


def route_to(host: str, port: int, source: str = "--rdzv-endpoint") -> str:
    """The source address the kernel would use to reach host: a UDP connect() picks the route
    and sends no packet."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"{source} {host}:{port}: the host does not resolve ({e.strerror}); "
                          "give node 0's address or a name every node can resolve") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as e:
            raise ConfigError(f"{source} {host}:{port}: no route from this node "
                              f"({e.strerror}); give an address this node can reach, or "
                              "--local-addr / --ifname") from None
        return s.getsockname()[0]


def check_local_addr(local_addr: str) -> None:
    try:
        ipaddress.ip_address(local_addr)
    except ValueError:
        raise ConfigError(f"--local-addr {local_addr} is not an IP address (IPv4 like 10.0.0.2, "
                          "or IPv6); give this node's address as the other nodes reach it") \
            from None


def pick_network(endpoint: str, local_addr: str | None, ifname: str | None,
                 source: str = "--rdzv-endpoint") -> NodeNetwork:
    """The interface and address for a multi-node job: the user's, or the route to the endpoint
    (`source` says where the endpoint came from, for messages)."""
    host, port = split_endpoint(endpoint, source)
    if ifname is not None and not ifname.strip():
        raise ConfigError("--ifname '' is empty; give an interface name (e.g. eth0) or leave "
                          "the flag out")
    if local_addr:
        check_local_addr(local_addr)
    if ifname and ifname not in {name for _, name in socket.if_nameindex()}:
        known = ", ".join(sorted(name for _, name in socket.if_nameindex()))
        raise ConfigError(f"--ifname {ifname}: no such interface on this node (it has: {known})")
    if local_addr and ifname:
        return NodeNetwork(ifname, local_addr, "given by --local-addr and --ifname")
    if ifname:
        addr = address_of(ifname)
        if addr is None:
            raise ConfigError(f"--ifname {ifname} has no address; give --local-addr too")
        return NodeNetwork(ifname, addr, f"given by --ifname, its address {addr}")
    if local_addr:
        return NodeNetwork(interface_of(local_addr), local_addr, "given by --local-addr")
    addr = route_to(host, port, source)
    if ipaddress.ip_address(addr).is_loopback and not _is_loopback_host(host):
        return _this_nodes_network(endpoint, addr, source)
    return NodeNetwork(interface_of(addr), addr, f"the route to {endpoint}")


def _is_loopback_host(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def non_loopback_ipv4() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of each interface of this node with a non-loopback address."""
    found = []
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        if addr and not ipaddress.ip_address(addr).is_loopback:
            found.append((name, addr))
    return found


def _this_nodes_network(endpoint: str, addr: str, source: str) -> NodeNetwork:
    """The endpoint names this node (node 0), and its own name maps to a loopback address here
    (Debian's /etc/hosts gives a host 127.0.1.1): the route to it is loopback, which the other
    nodes cannot reach, and gloo and NCCL pinned to it failed or hung at the first collective.
    This node's one other interface, where it has one; else the user says which."""
    others = non_loopback_ipv4()
    if len(others) == 1:
        name, other = others[0]
        return NodeNetwork(name, other, f"{endpoint} is this node, whose own route to it is "
                                        f"loopback ({addr}): its one other interface")
    choices = (f"give --ifname, one of {', '.join(name for name, _ in others)}" if others else
               "this node has no other interface with an IPv4 address; give --local-addr")
    raise ConfigError(
        f"{source} {endpoint} is this node, and its own name maps to a loopback address here "
        f"({addr}, as Debian's /etc/hosts does), which the other nodes cannot reach: {choices}, "
        "the network the nodes share")


def network_warnings(network: NodeNetwork, endpoint: str) -> list[str]:
    """What the flags chose that the other nodes will likely not reach: a loopback address
    where the endpoint is not one (all nodes on one machine may share loopback), an address no
    interface here holds (right only behind a NAT)."""
    said = []
    if _is_loopback_host(network.addr) and not _is_loopback_host(split_endpoint(endpoint)[0]):
        said.append(f"this node offers {network.addr} ({network.how}), a loopback address the "
                    f"other nodes cannot reach (the endpoint {endpoint} is not on this machine "
                    "alone): give --ifname or --local-addr of the network the nodes share")
    if network.ifname is None and "--local-addr" in network.how:
        said.append(f"--local-addr {network.addr} is on no interface of this node: the other "
                    "nodes must reach it there (behind a NAT); GLOO_SOCKET_IFNAME and "
                    "NCCL_SOCKET_IFNAME are not set, so the ranks choose their interface "
                    "themselves")
    return said


def check_ifname_variables(env=os.environ) -> None:
    """A user's GLOO_SOCKET_IFNAME must name interfaces this node has (a comma-separated list,
    as gloo takes it): partrain keeps it, and a name that is not there failed every rank at its
    first collective (gloo's `Unable to find address for: NAME`), after the run dir was written.
    NCCL_SOCKET_IFNAME is NCCL's to read (prefixes, `^` to exclude, `=` for exact names)."""
    given = env.get("GLOO_SOCKET_IFNAME")
    if not given:
        return
    known = {name for _, name in socket.if_nameindex()}
    missing = [name for name in given.split(",") if name.strip() not in known]
    if missing:
        raise ConfigError(f"GLOO_SOCKET_IFNAME={given}: no interface {', '.join(missing)} on this "
                          f"node (it has: {', '.join(sorted(known))}); unset it to let partrain "
                          "pick the interface, or name one of these")


def set_ifname_variables(network: NodeNetwork, env=os.environ) -> list[str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the workers; a user's own setting stays.
    Returns `NAME=value (how)` lines to print."""
    lines = []
    for name in IFNAME_VARIABLES:
        if env.get(name):
            lines.append(f"{name}={env[name]} (already set, kept)")
        elif network.ifname:
            env[name] = network.ifname
            lines.append(f"{name}={network.ifname}")
    return lines


def wait_for_endpoint(host: str, port: int, timeout_s: float) -> str | None:
    """Try to open a TCP connection to the rendezvous store until timeout_s has passed; None once
    it opens, else the last error (connection refused, no route, timed out)."""
    deadline = time.monotonic() + timeout_s
    problem = "timed out"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(
                    5.0, deadline - time.monotonic()))):
                return None
        except OSError as e:
            problem = e.strerror or str(e) or type(e).__name__
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return problem


def port_taken(port: int) -> str | None:
    """Why node 0 could not host the rendezvous store on `port` (it listens on every interface,
    as c10d's store does), or None: another process listening there (a second job, an old
    launcher) failed after the start with EADDRINUSE and a hint to look at the other nodes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            return e.strerror or str(e)
    return None
