"""A process in a private network namespace with only loopback up.

Mooncake's handshake listener, UCX and the servers bind every interface: in a namespace of its own a test reaches
nothing but 127.0.0.1 and leaves no port open on the machine.
"""

import os
import shutil
import subprocess


def tools_available() -> bool:
    return all(shutil.which(t) for t in ("unshare", "ip"))


def require_tools() -> None:
    from support.parts import require_part  # scripts import this module too

    require_part(tools_available(), "unshare (util-linux) and ip (iproute2)")


def private_net(argv: list, own_user: bool = False) -> list:
    """`argv` run in a new network namespace with loopback up; `own_user` also maps the caller to root in a new
    user namespace (`unshare -r`), which lets an unprivileged user make one."""
    return ["unshare", "-rn" if own_user else "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def run(argv: list, env: dict, timeout_s: float, own_user: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Run `argv` to its end in a private network namespace, its output captured as text."""
    return subprocess.run(private_net(argv, own_user), env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False, **kwargs)


def with_pythonpath(env: dict, *paths: str) -> dict:
    """`env` with `paths` first on PYTHONPATH (the project root, so a child imports the checkout)."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH")) if p))
