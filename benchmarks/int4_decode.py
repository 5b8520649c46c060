"""The GGUF's own quantized weights in decode steps of a few rows (`engine.gguf_int4_decode`,
the 4-bit decode step package: replicas/gguf_int4.py, its 4-bit linears and Q8_0 LM head run
by replicas/block_linear.cpp) against the dense decode step package, in one process,
alternating; and how close each stays to the file's exact weights.

Speed: the engine is the bench configs' (`serve-cpu-bench-bf16.yaml`: the default model, or
`--model gemma3-270m`, in bf16, compiled, 2 torch threads), built (or loaded) with its decode
step packages. For each batch size, after a warm-up, `--rounds` pairs of rounds run B requests
(a short prompt, or `--context` tokens, `--tokens` greedy tokens each) with the 4-bit package
installed and without it (`runner.compiled_int4_decode` set to None: those steps run the dense
decode step package, or for Gemma 3, which `compile_decode: auto` builds none for, the
compiled forward or the prefill package, as its split timing says);
ms a step is the runner's `forward` over the round's decode steps (benchmarks/decode_package.py
`timed_round`). Each pair's greedy outputs are compared token for token (both round to bf16,
at different points: near-tied logits may pick different tokens).

Fidelity (`--fidelity N`, eager transformers forwards, no packages): the model in fp32 holds
the GGUF's weights exactly (ggml's own dequantization); N texts (the benchmark's prompts and
the fp32 model's greedy answers to them) are scored teacher-forced by the fp32 model, by the
bf16 model, and by the bf16 model with its linears and LM head the file's blocks run by the
kernel (`BlockLinear`s, which take each row as two int8 terms). Printed: each bf16 variant's
top-1 agreement with fp32 and the mean KL(fp32 || variant) over the answer tokens. The
question it answers: is serving the file's quantized weights through the kernel as faithful
to the file as serving its bf16 expansion?

    .venv/bin/python -m benchmarks.int4_decode [--batches 1 2 4 8] [--tokens 128] [--rounds 3]
        [--fidelity 8] [--model gemma3-270m] [--context 300]

Last line: JSON with `ms_dense_<B>`, `ms_int4_<B>` (medians), `speedup_<B>` (dense ms over
4-bit ms), `same_outputs_<B>` (requests whose greedy outputs matched, of B x rounds) and with
`--fidelity` `top1_dense`, `top1_int4`, `kl_dense`, `kl_int4`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch

from benchmarks.common import bench_config_engine, emit, machine, setup_threads
from benchmarks.decode_package import PROMPT_WORDS, timed_round
from sessionserve.replicas import gguf_int4
from sessionserve.replicas.block_linear import BlockLinear
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import load_model


def speed(
    eng: Engine, batches: list[int], tokens: int, rounds: int, context: int = 0
) -> dict[str, Any]:
    """ms a decode step with and without the 4-bit package, alternating, per batch size."""
    runner = eng.runner
    int4 = runner.compiled_int4_decode
    if int4 is None:
        raise SystemExit(
            "the engine has no 4-bit decode step package (the log says why): it needs a bf16 "
            "model loaded from a GGUF with Q4_0 / Q4_1 / Q8_0 linears or LM head"
        )
    result: dict[str, Any] = {}
    for batch in batches:
        ms: dict[str, list[float]] = {"dense": [], "int4": []}
        same = 0
        timed_round(eng, batch, 8, -1, context)  # warm-up
        for r in range(rounds):
            outputs = {}
            for side in ("int4", "dense"):
                runner.compiled_int4_decode = int4 if side == "int4" else None
                step_ms, outputs[side] = timed_round(eng, batch, tokens, r, context)
                ms[side].append(step_ms)
            same += sum(a == b for a, b in zip(outputs["int4"], outputs["dense"], strict=True))
        runner.compiled_int4_decode = int4
        dense, four = statistics.median(ms["dense"]), statistics.median(ms["int4"])
        print(
            f"B={batch}: dense {dense:.2f} ms a step, 4-bit {four:.2f} ms ({dense / four:.2f}x); "
            f"rounds {[round(x, 2) for x in ms['dense']]} / {[round(x, 2) for x in ms['int4']]}; "
            f"same greedy outputs {same} of {batch * rounds}",
            flush=True,
        )
        result |= {
            f"ms_dense_{batch}": round(dense, 3),
            f"ms_int4_{batch}": round(four, 3),
            f"speedup_{batch}": round(dense / four, 3),
            f"same_outputs_{batch}": same,
        }
    return result


@torch.inference_mode()
def fidelity(texts: int, tokens: int, model_path: str = "default") -> dict[str, float]:
    """Top-1 agreement with the exact (fp32) model and KL(fp32 || variant), teacher-forced
    over the fp32 model's greedy answers, for bf16 dense and bf16 with the file's blocks."""
    loaded = load_model(model_path, torch.float32)
    exact, tok = loaded.model, loaded.tokenizer
    assert loaded.gguf is not None
    dense = copy.deepcopy(exact).to(torch.bfloat16)
    four = copy.deepcopy(dense)
    weights = gguf_int4.read_block_linears(
        loaded.gguf, four.get_decoder(), "model", four.config, lm_head=four.lm_head
    )
    head = weights.pop("lm_head", None)
    swapped = gguf_int4.swap_block_linears(four.get_decoder(), weights)
    if head is not None:
        four.lm_head = BlockLinear(head, None, torch.bfloat16)
    print(f"fidelity: {swapped} linears 4-bit, LM head Q8_0: {head is not None}", flush=True)
    agree = {"dense": [], "int4": []}
    kl = {"dense": [], "int4": []}
    for i in range(texts):
        text = f"Text {i}: say something about {PROMPT_WORDS}"
        if tok.chat_template is None:  # a base model (Gemma 3 270M): the text as it is
            prompt = tok(text, return_tensors="pt").input_ids
        else:
            chat = [{"role": "user", "content": text}]
            prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
            prompt = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
        ids = exact.generate(prompt, max_new_tokens=tokens, do_sample=False)
        answer = slice(prompt.shape[1] - 1, ids.shape[1] - 1)  # positions predicting it
        ref = torch.log_softmax(exact(ids).logits[0, answer].float(), -1)
        for name, model in (("dense", dense), ("int4", four)):
            got = torch.log_softmax(model(ids).logits[0, answer].float(), -1)
            agree[name].append((got.argmax(-1) == ref.argmax(-1)).float().mean().item())
            kl[name].append((ref.exp() * (ref - got)).sum(-1).mean().item())
    out = {}
    for name in ("dense", "int4"):
        out[f"top1_{name}"] = round(statistics.mean(agree[name]), 4)
        out[f"kl_{name}"] = round(statistics.mean(kl[name]), 6)
        print(
            f"fidelity, bf16 {name}: top-1 agreement with the exact weights "
            f"{out[f'top1_{name}']:.4f}, KL {out[f'kl_{name}']:.2e}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fidelity", type=int, default=0, help="texts to score (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="default", help="model.path (default, gemma3-270m)")
    ap.add_argument("--context", type=int, default=0, help="prompt tokens (0: a short one)")
    args = ap.parse_args()
    setup_threads(args.threads)
    result: dict[str, Any] = {"benchmark": "int4_decode", "machine": machine()}
    result["model"] = args.model
    eng = bench_config_engine(args.threads, "bfloat16", model_path=args.model)
    result |= speed(eng, args.batches, args.tokens, args.rounds, args.context)
    del eng
    if args.fidelity:
        result |= fidelity(args.fidelity, args.tokens, args.model)
    emit(result)


if __name__ == "__main__":
    main()
