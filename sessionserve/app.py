"""`build_app(args)`: the Serve application (the `import_path` target of deploy/*.yaml).

HTTP -> Ingress (FastAPI) -> SessionReplica (Engine), routed by SessionAffinityRouter
"""

from __future__ import annotations

from typing import Any

from ray import serve

from sessionserve.api.ingress import Ingress
from sessionserve.config import AppConfig
from sessionserve.replicas.server import ReplicaServer


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    cfg = AppConfig.model_validate(args or {})
    replica = serve.deployment(ReplicaServer).options(**ReplicaServer.deployment_options(cfg))
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=cfg.ingress.num_replicas,
        ray_actor_options={"num_cpus": cfg.ingress.num_cpus},
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
    )
    engine = cfg.engine.model_dump()
    return ingress.bind(
        replica.bind(engine, directory_shards=cfg.directory.shards), cfg.model_dump()
    )
