"""`train-drafter` on a tiny model: the checkpoint it writes loads back and drafts the same,
and an interrupted run resumes to the same weights."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sessionserve.cli import main as cli_main
from sessionserve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from sessionserve.errors import InvalidConfigError
from sessionserve.replicas.engine import Engine
from sessionserve.replicas.loader import load_model
from sessionserve.replicas.speculative.checkpoint import load_drafter
from sessionserve.training import drafter as training
from sessionserve.training.drafter import TrainConfig, train_drafter
from sessionserve.wire import SamplingParams
from tests.models import save_tiny_model, tiny_engine, tiny_model, word_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("target")
    save_tiny_model(d, seed=4)
    gen = torch.Generator().manual_seed(0)
    lines = [" ".join(f"w{t}" for t in torch.randint(5, 250, (8,), generator=gen).tolist())]
    lines += [
        " ".join(f"w{(i * 7 + j * 3) % 240 + 5}" for j in range(4 + i % 5)) for i in range(15)
    ]
    (d / "prompts.txt").write_text("\n".join(lines) + "\n")
    return d


def _cfg(target_dir: Path, out: Path, **kw) -> TrainConfig:
    fields = {
        "model": str(target_dir),
        "out": str(out),
        "prompts": str(target_dir / "prompts.txt"),
        "max_new_tokens": 12,
        "epochs": 2,
        "batch_seqs": 4,
        "draft_vocab": 64,
        "save_every": 1,
        "dtype": "float32",  # (auto is bf16 on a CPU with AMX: tokens would differ by machine)
        "self_prompts": 0,
        "sampled_answers": 1,
    }
    return TrainConfig(**(fields | kw))


def test_train_writes_the_eagle_layout_and_it_drafts_the_same(target_dir, tmp_path) -> None:
    out = tmp_path / "head"
    trained = train_drafter(_cfg(target_dir, out))
    weights = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "d2t"} <= set(weights)
    assert all(k.startswith(("fc.", "layers.0.", "d2t")) for k in weights)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 64
    assert config["eagle"]["sequences"] == 32  # 16 prompts: a greedy and a sampled answer each

    model = load_model(target_dir).model
    drafts = {}
    for name, make in {
        "trained": lambda m: trained.attach(m),
        "loaded": lambda m: load_drafter(out, m),
    }.items():
        engine = tiny_engine(model, drafter=make)
        seen: list[list[int]] = []
        propose = engine.speculative.eagle.propose

        def recording(reqs, lengths, propose=propose, seen=seen):
            chains = propose(reqs, lengths)
            seen.extend(c.tokens for c in chains)
            return chains

        engine.speculative.eagle.propose = recording
        outputs = [r.output_ids for r in engine.generate([[5, 9, 44, 3], [70, 8]], GREEDY)]
        drafts[name] = (seen, outputs)
    assert drafts["trained"] == drafts["loaded"]
    assert len(drafts["loaded"][0]) > 0


def test_an_interrupted_run_resumes_to_the_same_weights(target_dir, tmp_path, monkeypatch):
    straight = train_drafter(_cfg(target_dir, tmp_path / "straight"))
    real_save = training._save_state

    def save_then_crash(path, drafter, opt, sched, step, gen, schedule):
        real_save(path, drafter, opt, sched, step, gen, schedule)
        if step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(training, "_save_state", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(_cfg(target_dir, tmp_path / "resumed"))
    assert not (tmp_path / "resumed" / "model.safetensors").exists()
    monkeypatch.setattr(training, "_save_state", real_save)
    with pytest.raises(InvalidConfigError, match="re-run with the same options"):
        train_drafter(_cfg(target_dir, tmp_path / "resumed", epochs=3))  # another schedule
    with pytest.raises(InvalidConfigError, match="re-run with the same options"):
        train_drafter(_cfg(target_dir, tmp_path / "resumed", max_new_tokens=5))  # other data
    resumed = train_drafter(_cfg(target_dir, tmp_path / "resumed"))
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_cli_trains_and_the_engine_serves_with_the_result(target_dir, tmp_path, capsys) -> None:
    out = tmp_path / "cli-head"
    argv = ["train-drafter", "--model", str(target_dir), "--out", str(out)]
    argv += ["--prompts", str(target_dir / "prompts.txt"), "--max-new-tokens", "8"]
    argv += ["--self-prompts", "6", "--sampled-answers", "1", "--dtype", "float32"]
    assert cli_main(argv + ["--epochs", "1", "--draft-vocab", "0"]) == 0
    assert "wrote the EAGLE head" in capsys.readouterr().out
    made_for = torch.load(out / "dataset.pt", weights_only=True)["made_for"]
    assert made_for["self_prompts"] == 6 and made_for["sampled_answers"] == 1
    assert "d2t" not in load_file(str(out / "model.safetensors"))  # full vocabulary
    cfg = EngineConfig(
        model=ModelConfig(path=str(target_dir), dtype="float32"),  # as trained: exact tokens
        cache=CacheConfig(num_slots=2048, max_context_len=512),
        spec=SpecConfig(drafter_path=str(out), num_drafts=3, adaptive=False),
        memory_check="every_step",
    )
    spec, plain = Engine(cfg), Engine(cfg.model_copy(update={"spec": SpecConfig()}))
    prompts = [[5, 9, 44, 3], [70, 8, 120, 33, 4]]
    got, ref = spec.generate(prompts, GREEDY), plain.generate(prompts, GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert all(r.spec_steps > 0 for r in got)


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory, target_dir) -> Path:
    """A 7-layer target: EAGLE-3 reads the inputs of its layers 2, 3 and 4."""
    d = tmp_path_factory.mktemp("deep-target")
    save_tiny_model(d, seed=4, num_hidden_layers=7)
    (d / "prompts.txt").write_text((target_dir / "prompts.txt").read_text())
    return d


def test_eagle3_training_writes_the_published_layout_and_serves(deep_target_dir, tmp_path):
    from sessionserve.replicas.speculative.eagle3 import Eagle3Drafter

    out = tmp_path / "eagle3"
    trained = train_drafter(_cfg(deep_target_dir, out, arch="eagle3"))
    weights = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(weights)
    assert all(
        k.startswith(("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d")) for k in weights
    )
    assert tuple(weights["fc.weight"].shape) == (64, 3 * 64)
    assert tuple(weights["lm_head.weight"].shape) == (64, 64)  # the 64-token draft vocabulary
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}

    model = load_model(deep_target_dir).model
    runs = {}
    for name, make in {
        "trained": lambda m: trained.attach(m),
        "loaded": lambda m: load_drafter(out, m),
        "plain": None,
    }.items():
        engine = tiny_engine(model, drafter=make)
        seen: list[list[int]] = []
        if make is not None:
            assert isinstance(engine.speculative.eagle.drafter, Eagle3Drafter)
            propose = engine.speculative.eagle.propose
            engine.speculative.eagle.propose = lambda r, n, p=propose, s=seen: [
                s.append(c.tokens) or c for c in p(r, n)
            ]
        outputs = [r.output_ids for r in engine.generate([[5, 9, 44, 3], [70, 8]], GREEDY)]
        runs[name] = (seen, outputs)
    assert runs["trained"] == runs["loaded"]
    assert runs["loaded"][1] == runs["plain"][1]  # greedy output is the target's
    assert len(runs["loaded"][0]) > 0
    # a train state of one layout does not resume as the other
    (out / "model.safetensors").unlink()
    with pytest.raises(InvalidConfigError, match="re-run with the same options"):
        train_drafter(_cfg(deep_target_dir, out, arch="eagle"))


def test_eagle3_needs_three_target_layers(target_dir, tmp_path) -> None:
    with pytest.raises(InvalidConfigError, match="needs at least 3 layers"):
        train_drafter(_cfg(target_dir, tmp_path / "shallow", arch="eagle3"))


def test_self_prompts_are_written_by_the_target_then_answered(target_dir, tmp_path) -> None:
    """Magpie-style data: the target continues its chat template's empty user turn (`w2 `)
    until the turn ends (`w3`), then answers that prompt greedily like any other."""
    out = tmp_path / "self"
    cfg = _cfg(target_dir, out, max_prompts=0, self_prompts=24, sampled_answers=0, epochs=1)
    train_drafter(cfg)
    data = torch.load(out / "dataset.pt", weights_only=True)
    assert data["made_for"]["self_prompts"] == 24 and data["made_for"]["prompts"] == 0
    seqs = data["seqs"]
    assert 0 < len(seqs) <= 24  # prompts cut off at 96 tokens or repeated are dropped
    engine = tiny_engine(load_model(target_dir).model)
    prompts = []
    for seq in seqs:
        assert seq[0] == 2  # the user turn's opening, as the template writes it
        end = seq.index(3)  # the turn's end (the prompt stopped there), then the generation
        assert seq[end + 1] == 4  # prompt `w4`
        prompts.append(tuple(seq[1:end]))
        answer = engine.generate([seq[: end + 2]], SamplingParams(max_tokens=12, temperature=0))
        assert seq[end + 2 :] == answer[0].output_ids  # the target's own greedy answer
    assert len(set(prompts)) == len(prompts) and all(prompts)
    # the self-prompts are part of what a resumed run must match
    (out / "model.safetensors").unlink()
    with pytest.raises(InvalidConfigError, match="re-run with the same options"):
        train_drafter(TrainConfig(**(asdict(cfg) | {"self_prompts": 12})))


def test_a_base_model_writes_no_prompts_and_some_prompts_are_needed(target_dir, tmp_path, capsys):
    with pytest.raises(InvalidConfigError, match="--max-prompts 0 needs --self-prompts"):
        train_drafter(_cfg(target_dir, tmp_path / "none", max_prompts=0))
    (tmp_path / "empty.txt").write_text("\n")
    empty = _cfg(target_dir, tmp_path / "empty", prompts=str(tmp_path / "empty.txt"))
    with pytest.raises(InvalidConfigError, match="the prompt file has no prompts"):
        train_drafter(TrainConfig(**(asdict(empty) | {"max_prompts": 0, "self_prompts": 4})))
    tok = word_tokenizer()
    tok.chat_template = None  # a base model: no user turn to continue, so no self-prompts
    assert training._self_prompts(None, tok, 8, 0, set()) == []
    assert "no chat template" in capsys.readouterr().out
    with pytest.raises(InvalidConfigError, match="--dtype 'float8'"):
        train_drafter(_cfg(target_dir, tmp_path / "dtype", dtype="float8"))


@pytest.mark.parametrize("layers", [None, (1, 2, 3)])
def test_batched_features_equal_one_sequence_at_a_time(deep_target_dir, layers, monkeypatch):
    """The features phase right-pads sequences of different lengths into one forward: each
    sequence's states and labels are what a forward over it alone gives."""
    from sessionserve.replicas.hidden_states import decoder_features

    model = load_model(deep_target_dir).model
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (7, 30, 12, 30, 1, 19)]
    monkeypatch.setattr(training, "FEATURE_BATCH_TOKENS", 64)  # several batches, padding
    assert len(training._length_batches(seqs, 64)) > 1
    feats, labels, _ = training.target_features(model, seqs, layers)
    head = model.get_output_embeddings()
    for s, f, y in zip(seqs, feats, labels, strict=True):
        last, alone = decoder_features(
            model.get_decoder(), torch.tensor(s), torch.arange(len(s)), layers
        )
        torch.testing.assert_close(f, alone, rtol=1e-4, atol=1e-5)
        assert torch.equal(y, head(last).argmax(-1))


def test_soft_labels_are_the_targets_likeliest_draft_tokens(deep_target_dir) -> None:
    """With soft labels the features phase also keeps, per position, the target's k likeliest
    tokens within the draft vocabulary (as draft ids) and their probabilities renormalised
    over those k, from the logits that give the greedy labels."""
    from sessionserve.replicas.hidden_states import decoder_features

    model = load_model(deep_target_dir).model
    gen = torch.Generator().manual_seed(5)
    vocab_size = model.config.vocab_size
    vocab = torch.randperm(vocab_size, generator=gen)[:64].sort().values
    seqs = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (9, 21)]
    feats, labels, soft = training.target_features(model, seqs, None, (vocab, 4))
    head = model.get_output_embeddings()
    checked_greedy = 0
    for s, y, labels_s in zip(seqs, labels, soft, strict=True):
        last, _ = decoder_features(model.get_decoder(), torch.tensor(s), torch.arange(len(s)), None)
        within = head(last)[:, vocab]
        top, ids = within.topk(4, dim=-1)
        assert labels_s.draft_ids.shape == (len(s), 4)
        assert torch.equal(labels_s.draft_ids.long(), ids)
        torch.testing.assert_close(
            labels_s.probs.float(), torch.softmax(top, -1), atol=1e-3, rtol=0
        )
        in_vocab = torch.isin(y, vocab)
        assert torch.equal(vocab[labels_s.draft_ids[in_vocab, 0].long()], y[in_vocab])
        checked_greedy += int(in_vocab.sum())
    assert checked_greedy > 0


def test_one_soft_label_trains_as_the_greedy_token_and_more_train_otherwise(target_dir, tmp_path):
    """Over the whole vocabulary a soft label of one token is the greedy token with
    probability 1: the loss, hence the trained head, is the greedy labels' (so the soft path
    is the same loss where it should be); with four tokens the head learns something else.
    A run resumes only with the soft labels it started with."""
    hard = train_drafter(_cfg(target_dir, tmp_path / "hard", draft_vocab=0, soft_labels=0))
    one = train_drafter(_cfg(target_dir, tmp_path / "one", draft_vocab=0, soft_labels=1))
    four = train_drafter(_cfg(target_dir, tmp_path / "four", draft_vocab=0, soft_labels=4))
    a, b, c = hard.state_dict(), one.state_dict(), four.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    assert any(not torch.allclose(a[k], c[k], rtol=1e-3, atol=1e-4) for k in a)
    (tmp_path / "four" / "model.safetensors").unlink()
    with pytest.raises(InvalidConfigError, match="re-run with the same options"):
        train_drafter(_cfg(target_dir, tmp_path / "four", draft_vocab=0, soft_labels=2))
    with pytest.raises(InvalidConfigError, match="--soft-labels"):
        train_drafter(_cfg(target_dir, tmp_path / "negative", soft_labels=-1))


def test_answers_are_handed_over_in_groups_and_come_back_in_order(monkeypatch) -> None:
    """`_run` starts `REFILL` prompts at a time once that many have ended (so a prompt does
    not join every other step, which the 4-bit decode package would not run), and returns
    each job's result in the jobs' order: the answer each prompt gets alone."""
    engine = tiny_engine()
    scheduler = engine.config.scheduler.model_copy(update={"max_running_requests": 6})
    engine.config = engine.config.model_copy(update={"scheduler": scheduler})
    monkeypatch.setattr(training, "REFILL", 4)
    groups: list[list[int]] = []  # [running when handed over, how many], per group
    running, stepped = [0], [True]
    submit, step = engine.submit, engine.step

    def counted_submit(ids, params):
        if stepped[0]:
            groups.append([running[0], 0])
            stepped[0] = False
        groups[-1][1] += 1
        running[0] += 1
        return submit(ids, params)

    def counted_step():
        events = step()
        running[0] -= sum(e.result is not None for e in events)
        stepped[0] = True
        return events

    monkeypatch.setattr(engine, "submit", counted_submit)
    monkeypatch.setattr(engine, "step", counted_step)
    jobs = [
        ([5 + i, 9 + i, 40 + 2 * i], SamplingParams(max_tokens=3 + i % 7, temperature=0))
        for i in range(17)
    ]
    got = training._run(engine, jobs, "answers")
    alone = tiny_engine()
    for (ids, params), result in zip(jobs, got, strict=True):
        assert result.output_ids == alone.generate([ids], params)[0].output_ids
    assert groups[0] == [0, 6]  # the first fills the batch
    # later ones once 4 have ended (at most 2 running), filling it again; the last takes
    # what is left
    assert all(before <= 2 and before + handed == 6 for before, handed in groups[1:-1])
    assert groups[-1][0] <= 2 and sum(groups[-1]) <= 6 and len(groups) >= 4
    assert sum(handed for _, handed in groups) == len(jobs)
    engine.check_memory()


def test_answers_run_the_4bit_package_only_for_a_bf16_model_read_from_a_gguf() -> None:
    from sessionserve.replicas.loader import LoadedModel

    bf16 = tiny_model("llama").to(torch.bfloat16)
    fp32 = tiny_model("llama")

    def loaded(model, gguf):
        return LoadedModel(model=model, tokenizer=None, name="t", source="t", gguf=gguf)

    assert training._has_4bit_package(loaded(bf16, "/x/model.gguf"))
    assert not training._has_4bit_package(loaded(bf16, None))  # a transformers directory
    assert not training._has_4bit_package(loaded(fp32, "/x/model.gguf"))  # fp32: no such package


def test_features_run_in_fp32_only_where_its_gemms_are_the_faster(monkeypatch, capsys) -> None:
    """The features phase takes the fp32 copy where this CPU's fp32 GEMMs beat the serving
    dtype's by the prefill package's margin (timed by `prefill_choice.time_gemms`), else the
    model in the serving dtype; an fp32 target is used as it is, untimed."""
    from sessionserve.replicas import prefill_choice

    fp32 = tiny_model("llama")
    bf16 = tiny_model("llama").to(torch.bfloat16)
    timed: list[int] = []

    def timing(ms_bf16: float, ms_fp32: float):
        def time_gemms(model, rows):
            timed.append(rows)
            return prefill_choice.GemmTiming("cpu", "bfloat16", rows, ms_bf16, ms_fp32)

        return time_gemms

    monkeypatch.setattr(prefill_choice, "time_gemms", timing(3.0, 2.0))
    assert training._feature_model(bf16, fp32) is fp32
    assert "in float32, whose GEMMs ran 1.50x as fast as bfloat16's" in capsys.readouterr().out
    monkeypatch.setattr(prefill_choice, "time_gemms", timing(2.1, 2.0))  # under the margin
    assert training._feature_model(bf16, fp32) is bf16
    assert timed == [training.FEATURE_GEMM_ROWS] * 2
    assert training._feature_model(fp32, fp32) is fp32 and len(timed) == 2


def test_chain_acceptance_counts_each_answer_positions_run_of_right_drafts() -> None:
    """`chain_acceptance` (benchmarks/drafter_quality.py's measure): one chain per answer
    position with room for all k drafts, each 1 + its drafts in a row that match the target's
    greedy tokens; the vectorized chains equal each chain run alone over its own prefix, and
    labels the head always (never) drafts make every first draft right (wrong)."""
    from tests.models import random_drafter

    target = tiny_model(seed=3)
    head = random_drafter(target, seed=5)
    vocab, k, start = target.config.vocab_size, 3, 9
    seq = torch.randint(5, vocab, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    (feat,), (greedy,), _ = training.target_features(target, [seq], None)
    t2d = training.target_to_draft(head, vocab)

    runs = training.chain_acceptance(head, seq, feat, greedy, start, k, t2d)
    assert len(runs) == len(seq) - k - (start - 1)  # rows start-1 .. len-k-1
    for i, run in zip(range(start - 1, len(seq) - k), runs, strict=True):
        # the chain from row i alone: the prefix up to the last token it reads
        alone = training.chain_acceptance(
            head, seq[: i + k + 1], feat[: i + k + 1], greedy[: i + k + 1], i + 1, k, t2d
        )
        assert alone[-1] == run
    # labels set to the head's own first drafts: every first draft is right
    with torch.no_grad():
        first = head.draft_logits(
            head.features(torch.tensor(seq[1:])[None], feat[:-1][None], torch.arange(29)[None])[0]
        ).argmax(-1)
    drafted = greedy.clone()
    drafted[1:] = first
    assert min(training.chain_acceptance(head, seq, feat, drafted, start, k, t2d)) >= 2
    wrong = greedy.clone()
    wrong[1:] = (first + 1) % vocab  # never what the head drafts first
    assert set(training.chain_acceptance(head, seq, feat, wrong, start, k, t2d)) == {1}


def _one_sequence_loss(cfg, head, seq, feat, greedy, soft, t2d) -> torch.Tensor:
    """The loss of one sequence as EAGLE defines it, written from its slices (no padding):
    step j feeds token x[q+j] and the previous step's states (the target's at step 1), and
    learns the target's token after it (and, for an EAGLE head, its next state)."""
    regress = not isinstance(head, training.Eagle3Drafter)
    ids, hidden, loss = torch.tensor(seq), feat[:-1], torch.zeros(())
    scale = feat.pow(2).mean().sqrt()
    for step in range(cfg.unroll):
        n = hidden.shape[0]
        if n < 2:
            break
        rows = slice(1 + step, 1 + step + n)
        f = head.features(ids[None, rows], hidden[None], torch.arange(step, step + n)[None])[0]
        logits = head.draft_logits(f)
        if soft is None:  # (no label in the draft vocabulary: nothing to learn, not NaN)
            target = t2d[greedy[rows]]
            token = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
            token = token if bool((target >= 0).any()) else torch.zeros(())
        else:
            # mean over the positions of -sum p log q, q the head's softmax
            logq = torch.log_softmax(logits.float(), -1).gather(1, soft.draft_ids[rows].long())
            token = -(soft.probs[rows].float() * logq).sum(-1).mean()
        loss = loss + (cfg.token_loss_weight if regress else 1.0) * token
        if regress:
            loss = loss + torch.nn.functional.smooth_l1_loss(f / scale, feat[rows] / scale)
        hidden = f[:-1]
    return loss


@pytest.mark.parametrize(("layers", "soft_k"), [(None, 0), (None, 4), ((1, 2, 3), 4)])
def test_a_batch_trains_as_its_sequences_one_at_a_time(deep_target_dir, layers, soft_k) -> None:
    """Training puts a batch's sequences of different lengths through the head together,
    right-padded: the loss and its gradients are each sequence's own (`_one_sequence_loss`)
    weighted by its positions, and the first-draft statistics count every sequence."""
    model = load_model(deep_target_dir).model
    gen = torch.Generator().manual_seed(7)
    vocab = torch.randperm(model.config.vocab_size, generator=gen)[:64].sort().values
    seqs = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (9, 23, 2, 16, 3)]
    soft_arg = (vocab, soft_k) if soft_k else None
    feats, labels, soft = training.target_features(model, seqs, layers, soft_arg)
    torch.manual_seed(0)
    if layers is None:
        head = training.initial_drafter(model, vocab)
    else:
        head = training.initial_eagle3(model, vocab, layers)
    t2d = training.target_to_draft(head, model.config.vocab_size)
    cfg = TrainConfig(unroll=3, soft_labels=soft_k)
    soft = soft or [None] * len(seqs)
    params = [p for p in head.parameters() if p.requires_grad]

    examples = list(zip(seqs, feats, labels, soft, strict=True))
    batched, stats = training._batch_loss(cfg, head, examples, t2d, None)
    grads = torch.autograd.grad(batched, params)
    positions = [len(s) - 1 for s in seqs]
    one_by_one = sum(
        _one_sequence_loss(cfg, head, s, f, y, sl, t2d) * n
        for s, f, y, sl, n in zip(seqs, feats, labels, soft, positions, strict=True)
    ) / sum(positions)
    expected = torch.autograd.grad(one_by_one, params)
    torch.testing.assert_close(batched, one_by_one, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    assert batched.item() > 0
    # first drafts counted: a sequence's positions with a label in the draft vocabulary (at
    # least 1; a 2-token sequence trains none)
    counted = [
        max(1, int((t2d[y[1:]] >= 0).sum())) if len(s) > 2 else 1
        for s, y in zip(seqs, labels, strict=True)
    ]
    assert stats[2].item() == sum(counted)


def test_the_heads_products_run_in_bf16_only_where_the_target_runs_in_bf16(target_dir) -> None:
    """`_mixed_precision(bf16)` computes the head's matrix products in bf16: a loss a bf16
    rounding from fp32's, its gradients still fp32 for fp32 weights; with fp32 nothing
    changes."""
    model = load_model(target_dir).model
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (12, 20)]
    feats, labels, _ = training.target_features(model, seqs, None)
    torch.manual_seed(0)
    head = training.initial_drafter(model, torch.arange(model.config.vocab_size))
    t2d = training.target_to_draft(head, model.config.vocab_size)
    examples = [(s, f, y, None) for s, f, y in zip(seqs, feats, labels, strict=True)]
    cfg = TrainConfig()
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        with training._mixed_precision(dtype):
            losses[dtype], _ = training._batch_loss(cfg, head, examples, t2d, None)
        head.zero_grad()
        losses[dtype].backward()
        assert all(p.grad.dtype == torch.float32 for p in head.parameters() if p.requires_grad)
    plain, _ = training._batch_loss(cfg, head, examples, t2d, None)
    assert torch.equal(losses[torch.float32], plain)
    assert not torch.equal(losses[torch.bfloat16], plain)
    torch.testing.assert_close(losses[torch.bfloat16], plain, rtol=3e-2, atol=0)
