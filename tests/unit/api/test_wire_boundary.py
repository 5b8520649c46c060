"""The ingress side of the wire loads no torch: an ingress process (and the session router in
it) imports `sessionserve.wire` and the API, never a replica module."""

from __future__ import annotations

import subprocess
import sys


def test_the_ingress_and_router_import_neither_torch_nor_the_replica_package() -> None:
    code = (
        "import sys\n"
        "import sessionserve.api.ingress, sessionserve.router.session_router\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "replica = [m for m in sys.modules if m.startswith(('sessionserve.replicas',"
        " 'sessionserve.cache'))]\n"
        "print(heavy, replica)\n"
        "sys.exit(1 if heavy or replica else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
