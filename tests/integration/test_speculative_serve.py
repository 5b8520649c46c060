"""Speculative decoding through the served application: a second Serve app in the same cluster
whose replica loads an EAGLE head from disk (`engine.spec.drafter_path`) and drafts from each
session's history too (`engine.spec.history_drafts`), driven by the
official `openai` client over HTTP. Answers equal a non-speculative engine's; usage reports
the drafts kept and rejected, and a real Prometheus sees the same figures in the replica's
speculation metrics; the replica's memory invariant holds (strict mode)."""

from __future__ import annotations

import copy

import openai
import pytest

from sessionserve.config import AppConfig
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.speculative.checkpoint import save_drafter
from sessionserve.wire import SamplingParams
from tests.conftest import app_args, extra_app, free_port
from tests.e2e.prometheus import Prometheus, ensure_prometheus
from tests.models import mimic_drafter, save_tiny_model

pytestmark = pytest.mark.ray
SPEC_APP = "spec"


@pytest.fixture(scope="module")
def spec_served(served, tmp_path_factory):

    model_dir = tmp_path_factory.mktemp("spec-model")
    save_tiny_model(model_dir, seed=3, num_hidden_layers=1)
    args = app_args(str(model_dir))
    engine_cfg = AppConfig.model_validate(args).engine
    plain = Engine(engine_cfg.model_copy(update={"memory_check": "every_step"}))
    drafter_dir = tmp_path_factory.mktemp("spec-head")
    save_drafter(mimic_drafter(copy.deepcopy(plain.loaded.model)), drafter_dir)
    args["engine"]["spec"] = {
        "drafter_path": str(drafter_dir),
        "num_drafts": 4,
        "history_drafts": True,  # the head and the session's history draft side by side
        "adaptive": False,  # drafting every step: what this test checks is not timing
    }
    # the main app holds 1.5 of the cluster's 2 CPUs: this one must fit in the rest
    args["replica"].update(num_replicas=1, num_cpus=0.25)
    args["ingress"].update(num_replicas=1, num_cpus=0.125)
    with extra_app(served, SPEC_APP, args, wait_s=60) as base:
        yield {"base": base, "plain": plain, "model": model_dir.name}


def test_session_chat_with_speculation_equals_plain_decoding(spec_served) -> None:
    from ray import serve

    client = openai.OpenAI(base_url=f"{spec_served['base']}/v1", api_key="x", max_retries=0)
    plain: Engine = spec_served["plain"]
    tok = plain.tokenizer
    sid = client.post("/sessions", body={}, cast_to=dict)["id"]
    messages: list[dict] = []
    accepted = rejected = 0
    for turn in range(3):
        messages.append(
            {"role": "user", "content": " ".join(f"w{30 + turn * 7 + j}" for j in range(9))}
        )
        r = client.chat.completions.create(
            model=spec_served["model"],
            messages=messages,
            max_tokens=24,
            temperature=0,
            extra_headers={"x-session-id": sid},
        )
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        (ref,) = plain.generate([ids], SamplingParams(max_tokens=24, temperature=0))
        answer = r.choices[0].message.content
        assert answer == ref.text
        if turn:
            assert r.usage.prompt_tokens_details.cached_tokens > 0
        details = r.usage.completion_tokens_details
        accepted += details.accepted_prediction_tokens
        rejected += details.rejected_prediction_tokens
        messages.append({"role": "assistant", "content": answer})
    assert accepted > 0 and rejected > 0
    client.delete(f"/sessions/{sid}", cast_to=dict)
    handle = serve.get_deployment_handle("SessionReplica", app_name=SPEC_APP)
    terms = handle.memory_check.remote().result(timeout_s=30)  # raises if broken
    assert terms["held"] == terms["in_flight"] == terms["live_requests"] == 0, terms
    assert terms["free"] + terms["evictable"] + terms["protected"] == terms["total"]
    spec_served["accepted"], spec_served["drafted"] = accepted, accepted + rejected
    spec_served["replica"] = terms["replica"]


def test_speculation_metrics_reach_prometheus(served, spec_served) -> None:
    """After the chat above: this replica's counters equal what usage reported, and the
    acceptance-length histogram adds up (sum of lengths = accepted drafts + verify steps)."""
    if "replica" not in spec_served:
        pytest.skip("needs the chat test's figures")
    binary = ensure_prometheus()
    if binary is None:
        pytest.skip("Debian's prometheus package cannot be installed on this machine")
    prom = Prometheus(binary, f"127.0.0.1:{served['metrics_port']}", free_port())
    try:
        prom.wait_ready()
        sel = f'{{replica="{spec_served["replica"]}"}}'
        try:
            prom.wait_for(
                f"sum(ray_sessionserve_spec_accepted_tokens_total{sel})",
                lambda v: v == spec_served["accepted"],
                timeout_s=60,
            )
        except AssertionError as e:  # say which replicas' counters did arrive
            seen = prom.query("sum by (replica) (ray_sessionserve_memory_checks_total)")
            raise AssertionError(f"{e}; replicas exporting: {seen}") from None
        drafted = prom.value(f"sum(ray_sessionserve_spec_drafted_tokens_total{sel})")
        assert drafted == spec_served["drafted"]
        steps = prom.value(f"sum(ray_sessionserve_spec_accept_length_count{sel})")
        lengths = prom.value(f"sum(ray_sessionserve_spec_accept_length_sum{sel})")
        assert steps and lengths == spec_served["accepted"] + steps
    finally:
        prom.stop()
