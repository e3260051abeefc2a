"""Runs inside the sandbox before the command (rlray.envs.sandbox): `python3 -I -S launch.py SPEC ARGV...`.

SPEC (JSON): `ports`, loopback ports to listen on inside the sandbox's network namespace, whose listening sockets go
to the host over the Unix socket `socket` (SCM_RIGHTS) so that the host serves them (the relay to the model
endpoint; nothing listens inside once the command runs); `limits`, rlimits by name (CPU, NOFILE, FSIZE, CORE, AS,
NPROC), set before the command is exec'd. Standard library only, no site packages: any python3 under /usr runs it.
"""

import json
import os
import resource
import socket
import sys


def main() -> None:
    spec, argv = json.loads(sys.argv[1]), sys.argv[2:]
    if spec["ports"]:
        listeners = []
        for port in spec["ports"]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", port))
            s.listen(64)
            listeners.append(s)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as host:
            host.connect(spec["socket"])
            socket.send_fds(host, [b"ports"], [s.fileno() for s in listeners])
            host.recv(1)  # the host has its copies
        for s in listeners:
            s.close()
    for name, value in spec["limits"].items():
        limit = getattr(resource, f"RLIMIT_{name}")
        resource.setrlimit(limit, (value, value))
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"sandbox: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
