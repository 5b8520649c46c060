"""`build_app(args)`: the Serve application (the `import_path` target of deploy/*.yaml), and
each deployment's Serve options from the app config.

HTTP -> Ingress (FastAPI) -> SessionReplica (Engine), routed by SessionAffinityRouter;
with `ingress.colocated`: HTTP -> SessionReplica (the ingress's routes and the engine in one
process, sessionserve/colocated.py)
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from sessionserve.api.ingress import Ingress
from sessionserve.colocated import ColocatedServer
from sessionserve.config import REPLICA_ENV_DEFAULTS, AppConfig
from sessionserve.replicas.server import ReplicaServer
from sessionserve.router.session_router import SessionAffinityRouter

POWER_OF_TWO_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    cfg = AppConfig.model_validate(args or {})
    if cfg.ingress.colocated:
        return colocated_app(cfg)
    replica = serve.deployment(ReplicaServer).options(**replica_options(cfg))
    ingress = serve.deployment(Ingress).options(**ingress_options(cfg))
    engine = cfg.engine.model_dump()
    return ingress.bind(
        replica.bind(
            engine,
            directory_shards=cfg.directory.shards,
            stream_interval_ms=cfg.replica.stream_interval_ms,
            stream_messages_per_s=cfg.stream_message_budget(),
        ),
        cfg.model_dump(),
    )


def colocated_app(cfg: AppConfig) -> serve.Application:
    """One deployment: the ingress's routes over the engine, in the replica's process, with
    the replica's resources, environment and health checks and the ingress's request limit
    (the replica's own limits apply to turns inside it: `colocated.Admission`)."""
    opts = replica_options(cfg)
    for routing in ("request_router_config", "max_queued_requests"):
        del opts[routing]  # one replica, no router; turns queue inside (colocated.Admission)
    opts["max_ongoing_requests"] = cfg.ingress.max_ongoing_requests
    return (
        serve.deployment(ColocatedServer)
        .options(**opts)
        .bind(cfg.engine.model_dump(), cfg.model_dump())
    )


def ingress_options(cfg: AppConfig) -> dict[str, Any]:
    i = cfg.ingress
    return {
        "name": "Ingress",
        "num_replicas": i.num_replicas,
        "ray_actor_options": {"num_cpus": i.num_cpus},
        "max_ongoing_requests": i.max_ongoing_requests,
    }


def replica_options(cfg: AppConfig) -> dict[str, Any]:
    """The model replicas' Serve options, from the app config's `replica` section (and the
    directory's shard count, which the session router needs)."""
    r = cfg.replica
    sticky = r.request_router == "session_affinity"
    opts: dict[str, Any] = {
        "name": "SessionReplica",
        "ray_actor_options": {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
        "max_ongoing_requests": r.max_ongoing_requests,
        "max_queued_requests": r.max_queued_requests,
        "health_check_period_s": r.health_check_period_s,
        "graceful_shutdown_timeout_s": r.graceful_shutdown_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=SessionAffinityRouter if sticky else POWER_OF_TWO_ROUTER,
            request_router_kwargs={"directory_shards": cfg.directory.shards} if sticky else {},
            request_routing_stats_period_s=r.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 2 * r.routing_stats_period_s),
        ),
    }
    env = REPLICA_ENV_DEFAULTS | r.env_vars
    opts["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    if r.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = r.max_replicas_per_node
    if r.autoscaling is not None:
        a = r.autoscaling
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            target_ongoing_requests=a.target_ongoing_requests,
        )
    else:
        opts["num_replicas"] = r.num_replicas
    return opts
