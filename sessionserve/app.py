"""`build_app(args)`: the Serve application (the `import_path` target of deploy/*.yaml).

HTTP -> Ingress (FastAPI) -> SessionReplica (Engine), routed by SessionAffinityRouter
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig as ServeAutoscaling
from ray.serve.config import RequestRouterConfig

from sessionserve.api.ingress import Ingress
from sessionserve.config import AppConfig
from sessionserve.replicas.server import ReplicaServer
from sessionserve.router.session_router import SessionAffinityRouter

POWER_OF_TWO_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def replica_options(cfg: AppConfig) -> dict[str, Any]:
    r = cfg.replica
    opts: dict[str, Any] = {
        "name": "SessionReplica",
        "ray_actor_options": {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
        "max_ongoing_requests": r.max_ongoing_requests,
        "max_queued_requests": r.max_queued_requests,
        "health_check_period_s": r.health_check_period_s,
        "graceful_shutdown_timeout_s": r.graceful_shutdown_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=SessionAffinityRouter
            if r.request_router == "session_affinity"
            else POWER_OF_TWO_ROUTER,
            request_routing_stats_period_s=r.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 2 * r.routing_stats_period_s),
        ),
    }
    if r.env_vars:
        opts["ray_actor_options"]["runtime_env"] = {"env_vars": dict(r.env_vars)}
    if r.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = r.max_replicas_per_node
    if r.autoscaling is not None:
        a = r.autoscaling
        opts["autoscaling_config"] = ServeAutoscaling(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            target_ongoing_requests=a.target_ongoing_requests,
        )
    else:
        opts["num_replicas"] = r.num_replicas
    return opts


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    cfg = AppConfig.model_validate(args or {})
    replica = serve.deployment(ReplicaServer).options(**replica_options(cfg))
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=cfg.ingress.num_replicas,
        ray_actor_options={"num_cpus": cfg.ingress.num_cpus},
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
    )
    return ingress.bind(replica.bind(cfg.engine.model_dump()), cfg.model_dump())
