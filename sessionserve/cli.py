"""`sessionserve` command line: demo, chat, train-drafter, config-schema."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEMO_TURNS = (
    "What is the capital of France?",
    "And what is the capital of Germany?",
    "What is the capital of Italy?",
    "Which language do people speak there?",
)


def _demo(args: argparse.Namespace) -> int:
    """A multi-turn conversation on one streaming session, in-process (no Ray yet)."""
    from sessionserve.config import CacheConfig, EngineConfig, ModelConfig
    from sessionserve.replicas.engine import Engine
    from sessionserve.replicas.prompts import chat_input_ids
    from sessionserve.wire import SamplingParams

    print("sessionserve demo: the replica engine in-process (no Ray): one session, several")
    print("turns, KV kept between turns. `make serve` runs the full Ray Serve application.\n")
    t0 = time.monotonic()
    cfg = EngineConfig(
        model=ModelConfig(path=args.model, torch_threads=args.threads),
        cache=CacheConfig(num_slots=8192, max_rows=32),
        memory_check="every_step",
        compile=False,  # a demo of a few turns: no background build competing with it
    )
    engine = Engine(cfg)
    print(f"loaded {engine.model_name} in {time.monotonic() - t0:.1f} s\n")
    sid = engine.open_session()
    messages: list[dict] = []
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for question in DEMO_TURNS[: args.turns]:
        messages.append({"role": "user", "content": question})
        ids = chat_input_ids(engine.tokenizer, engine.model_name, messages)
        (r,) = engine.generate([ids], greedy, session_id=sid, mode="chat")
        messages.append({"role": "assistant", "content": r.text})
        print(f"user> {question}\nassistant> {r.text}")
        print(
            f"   [prompt {r.prompt_tokens} tok, cached {r.cached_tokens} ({r.cached_source}), "
            f"TTFT {1000 * (r.ttft_s or 0):.0f} ms, {r.completion_tokens} tok]\n"
        )
    info = engine.session_info(sid)
    print(
        f"session {sid}: {info.turns} turns, {info.history_tokens} tokens of history, "
        f"{info.held_tokens} KV tokens held"
    )
    engine.close_session(sid)
    engine.checker.check_idle()
    print("closed; memory invariant holds (every KV slot accounted for)")
    return 0


def _config_schema(_: argparse.Namespace) -> int:
    from sessionserve.config import AppConfig

    print(json.dumps(AppConfig.model_json_schema(), indent=2))
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    from sessionserve.training.drafter import TrainConfig, train_drafter

    fields = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    train_drafter(cfg)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from sessionserve.chat_cli import run_chat

    return run_chat(args.url, args.model, args.max_tokens, args.session)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sessionserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="multi-turn session demo on the default model")
    demo.add_argument("--model", default="default", help="model path (default: SmolLM2)")
    demo.add_argument("--turns", type=int, default=len(DEMO_TURNS), help="turns to run")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    demo.add_argument("--threads", type=int, default=None, help="torch threads")
    demo.set_defaults(func=_demo)
    chat = sub.add_parser("chat", help="interactive chat over one session with a running server")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    chat.add_argument("--model", default=None, help="model id (default: the served one)")
    chat.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    chat.add_argument("--session", default=None, help="session id (default: a new one)")
    chat.set_defaults(func=_chat)
    train = sub.add_parser(
        "train-drafter",
        help="train an EAGLE draft head for a model on this machine (resumable)",
        description="Self-distillation: the model writes user turns of its own and answers "
        "them and the shipped prompts, then a one-layer EAGLE head learns to predict its next "
        "hidden state and token. Re-run the same command to resume an interrupted run.",
    )
    train.add_argument("--model", help="target model path (default: SmolLM2)")
    train.add_argument("--out", help="output directory (default: drafters/default)")
    train.add_argument(
        "--arch",
        choices=["eagle", "eagle3"],
        help="head layout: eagle (EAGLE-1/2, the last hidden state; default) or eagle3 "
        "(three target layers fused, its own draft vocabulary)",
    )
    train.add_argument("--prompts", help="prompt file, one per line (default: shipped set)")
    train.add_argument(
        "--max-prompts", type=int, help="use only the first N prompts (0: only self-prompts)"
    )
    train.add_argument(
        "--self-prompts",
        type=int,
        help="user turns the model writes itself and then answers (default 800; 0: only "
        "the prompt file's)",
    )
    train.add_argument(
        "--sampled-answers",
        type=int,
        help="answers per prompt at temperature 0.7, besides the greedy one (default 0; 1 "
        "with --epochs 4: twice the text, a better head in ~1.3x the time)",
    )
    train.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        help="the model's dtype for the answers and the hidden states the head learns from "
        "(default auto: what serving picks on this machine, bf16 where the CPU has it)",
    )
    train.add_argument("--max-new-tokens", type=int, help="answer length per prompt")
    train.add_argument("--epochs", type=int, help="passes over the data (default 8)")
    train.add_argument("--lr", type=float, help="peak learning rate")
    train.add_argument(
        "--unroll", type=int, help="chain steps trained, 2+ on the head's own outputs (default 2)"
    )
    train.add_argument(
        "--soft-labels",
        type=int,
        help="learn the target's K likeliest next tokens and their probabilities, not only "
        "its greedy token (default 32; 0: the greedy token alone)",
    )
    train.add_argument("--draft-vocab", type=int, help="draft vocabulary size (0 = all)")
    train.add_argument("--threads", type=int, help="torch threads")
    train.add_argument("--seed", type=int, help="shuffling and noise seed")
    train.set_defaults(func=_train_drafter)
    schema = sub.add_parser("config-schema", help="print the app config's JSON schema")
    schema.set_defaults(func=_config_schema)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
