"""lm-evaluation-harness on an exported lcsm model: its multiple-choice accuracy on the local task
lcsm_facts equals lcsm's own scoring of the same examples (each choice's summed log-probability
with lcsm's model and tokenizer, argmax), example by example; ``lcsm eval-harness`` on an export
and on a run; lm_eval's own command line through ``python -m lcsm.hf.harness``; clear errors."""

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (lcsm's 'hf' extra: pip install -e '.[hf]')")
pytest.importorskip("lm_eval", reason="lm_eval is not installed (lcsm's 'eval' extra: pip install -e '.[eval]')")

import json
import sys
from types import SimpleNamespace

import torch
import yaml
from cli.conftest import TINY  # tests/ is on sys.path (pytest inserts the base of the test packages)

from lcsm.cli import main
from lcsm.hf import LcsmConfig, LcsmForCausalLM, harness
from lcsm.hf.export import byte_tokenizer, task_tokenizer
from lcsm.tasks.lm import BPETokenizer, ByteTokenizer

DOCS = [json.loads(line) for line in (harness.TASKS_DIR / "lcsm_facts.jsonl").read_text().splitlines()]


@pytest.fixture
def no_built_in_tasks(monkeypatch):
    """lm_eval's TaskManager without its built-in tasks (indexing their thousands of YAMLs takes
    seconds to tens of seconds); the list returned records each one's ``include_defaults``."""
    from lm_eval.tasks import TaskManager

    asked = []

    def manager(include_path=None, include_defaults=True, **kwargs):
        asked.append(include_defaults)
        return TaskManager(include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr("lm_eval.tasks.TaskManager", manager)
    return asked


def prompt(doc) -> str:
    return f"Question: {doc['question']}\nAnswer:"  # the task's doc_to_text


def export(tmp_path, tokenizer: str, mixer: str):
    """A random tiny model and its tokenizer saved as a Hugging Face directory; returns the directory,
    lcsm's own model (the CausalLM inside) and lcsm's own tokenizer."""
    if tokenizer == "byte":
        ours, theirs = ByteTokenizer(), byte_tokenizer()
    else:
        texts = [f"{prompt(d)} {c}" for d in DOCS for c in d["choices"]]
        ours = BPETokenizer.train(texts, vocab_size=320)
        theirs = task_tokenizer(SimpleNamespace(tokenizer=ours))  # as `lcsm export` writes an lm task's BPE
    torch.manual_seed(0)
    lcsm = dict(mixer=mixer, vocab_size=ours.vocab_size, d_model=32, n_layers=2)
    config = LcsmConfig(lcsm=lcsm, eos_token_id=ours.eod)
    model = LcsmForCausalLM(config).eval()
    out = tmp_path / f"hf-{tokenizer}"
    model.save_pretrained(out)
    theirs.save_pretrained(out)
    return out, model.model, ours


@torch.no_grad()
def lcsm_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log P(continuation | context) with lcsm's model and tokenizer, split into tokens as lm_eval's
    causal models do (TemplateLM._encode_pair): the context's trailing spaces move to the continuation,
    and the continuation's tokens are those of the whole text past the context's own tokens."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    ctx = tok.encode(context)
    cont = tok.encode(context + continuation)[len(ctx) :]
    ids = torch.tensor([ctx + cont])
    logp = torch.log_softmax(model(ids[:, :-1]).float(), dim=-1)[0, len(ctx) - 1 :]
    return logp.gather(1, torch.tensor(cont)[:, None]).sum().item()


def lcsm_scores(model, tok, docs):
    """Per example: each choice's log-likelihood (after lm_eval's target delimiter, a space) and the
    argmax (the first of equal ones, as numpy's)."""
    scores = [[lcsm_loglikelihood(model, tok, prompt(d), " " + c) for c in d["choices"]] for d in docs]
    return scores, [max(range(len(s)), key=s.__getitem__) for s in scores]


def accuracy(picks, docs) -> float:
    return sum(p == d["answer"] for p, d in zip(picks, docs, strict=True)) / len(docs)


@pytest.mark.parametrize("tokenizer, mixer", [("byte", "gla"), ("bpe", "mamba")])
def test_harness_accuracy_equals_lcsm_own_scoring(tmp_path, tokenizer, mixer):
    out, model, tok = export(tmp_path, tokenizer, mixer)
    result = harness.evaluate(out, ["lcsm_facts"], batch_size=8, log_samples=True)
    samples = sorted(result["samples"]["lcsm_facts"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == DOCS  # every example, in order

    scores, picks = lcsm_scores(model, tok, DOCS)
    theirs = [[ll for ll, _ in s["filtered_resps"]] for s in samples]
    torch.testing.assert_close(torch.tensor(theirs), torch.tensor(scores), rtol=1e-5, atol=1e-4)
    assert [max(range(4), key=t.__getitem__) for t in theirs] == picks
    assert [s["acc"] for s in samples] == [float(p == d["answer"]) for p, d in zip(picks, DOCS, strict=True)]
    assert result["results"]["lcsm_facts"]["acc,none"] == pytest.approx(accuracy(picks, DOCS), abs=1e-12)


def test_an_include_path_task_over_a_local_jsonl(tmp_path):
    # A task of one's own, as lm_eval's docs write them: dataset_path json over an absolute path
    # (its cache in tmp_path; HF_DATASETS_OFFLINE is set, so nothing could be fetched).
    out, model, tok = export(tmp_path, "byte", "gla")
    task = yaml.safe_load((harness.TASKS_DIR / "lcsm_facts.yaml").read_text().replace("!function ", ""))
    del task["custom_dataset"]
    data = {"data_files": {"test": str(harness.TASKS_DIR / "lcsm_facts.jsonl")}, "cache_dir": str(tmp_path / "cache")}
    task.update(task="my_facts", dataset_path="json", dataset_kwargs=data)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "my_facts.yaml").write_text(yaml.safe_dump(task))
    result = harness.evaluate(out, ["my_facts"], include_paths=[tmp_path / "tasks"], limit=8, log_samples=True)
    samples = sorted(result["samples"]["my_facts"], key=lambda s: s["doc_id"])
    _, picks = lcsm_scores(model, tok, DOCS[:8])
    assert [max(range(4), key=[ll for ll, _ in s["filtered_resps"]].__getitem__) for s in samples] == picks
    assert result["results"]["my_facts"]["acc,none"] == pytest.approx(accuracy(picks, DOCS[:8]), abs=1e-12)


def test_cli_on_an_export_prints_the_table_and_writes_json(tmp_path, capsys):
    out, model, tok = export(tmp_path, "byte", "gla")
    path = tmp_path / "results.json"
    args = ["eval-harness", str(out), "--tasks", "lcsm_facts", "--limit", "8", "--batch-size", "3"]
    assert main([*args, "--out", str(path), "--log-samples", "--model-args", "max_length=64"]) == 0
    printed = capsys.readouterr().out
    assert "lcsm_facts" in printed and "acc" in printed and f"results: {path}" in printed
    written = json.loads(path.read_text())
    _, picks = lcsm_scores(model, tok, DOCS[:8])
    assert written["results"]["lcsm_facts"]["acc,none"] == pytest.approx(accuracy(picks, DOCS[:8]), abs=1e-12)
    assert written["n-samples"]["lcsm_facts"]["effective"] == 8 and len(written["samples"]["lcsm_facts"]) == 8
    assert written["config"]["model_args"]["max_length"] == 64


def test_cli_on_a_run_exports_it_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, d in enumerate(DOCS):
        (corpus / f"{i:02d}.txt").write_text(f"{prompt(d)} {d['choices'][d['answer']]}\n" * 2)
    task = {"name": "lm", "corpus": f"path:{corpus}", "tokenizer": "byte", "seq_len": 16}
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "task": task, "model": {**TINY["model"], "vocab_size": 257}}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 0
    assert main(["eval-harness", str(run), "--tasks", "lcsm_facts", "--limit", "4"]) == 0
    assert "exported" in capsys.readouterr().out
    written = json.loads((run / "eval-harness.json").read_text())
    assert written["n-samples"]["lcsm_facts"]["effective"] == 4 and "samples" not in written


def test_lm_eval_command_line_through_lcsm(tmp_path, monkeypatch, no_built_in_tasks, capsys):
    out, _, _ = export(tmp_path, "byte", "gla")
    argv = ["python -m lcsm.hf.harness", "run", "--model", "hf", "--model_args", f"pretrained={out},backend=causal"]
    argv += ["--tasks", "lcsm_facts", "--include_path", str(harness.TASKS_DIR), "--limit", "4", "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", [*argv, "--output_path", str(tmp_path / "lm_eval")])
    harness.main()
    assert no_built_in_tasks == [True]  # lm_eval's command line looked among its built-in tasks too
    assert "lcsm_facts" in capsys.readouterr().out
    (written,) = (tmp_path / "lm_eval").rglob("results_*.json")
    assert json.loads(written.read_text())["n-samples"]["lcsm_facts"]["effective"] == 4


def test_help_names_the_options_and_the_local_task(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval-harness", "--help"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert all(word in printed for word in ("MODEL_DIR", "--tasks", "--include-path", "--limit", "lcsm_facts"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/model", "--tasks", "lcsm_facts"], "MODEL_DIR: '/nonexistent/model' is not a directory"),
        (["{model}", "--tasks", ","], "--tasks: give at least one task name"),
        (["{model}", "--tasks", "lcsm_facts", "--limit", "0"], "--limit: expected a positive number"),
        (["{model}", "--tasks", "lcsm_facts", "--include-path", "/nonexistent"], "'/nonexistent' is not a directory"),
        (["{model}", "--tasks", "lcsm_facts", "--model-args", "dtype"], "--model-args: expected KEY=VALUE"),
        (["{bare}", "--tasks", "lcsm_facts"], "has no tokenizer (tokenizer.json)"),
        (["{model}", "--tasks", "lcsm_facts", "--best"], "is an exported model, not a run (--best picks"),
        (["{empty}", "--tasks", "lcsm_facts"], "no config.json (not an exported model), read as a run: checkpoint"),
    ],
)
def test_user_errors_are_one_line(tmp_path, capsys, args, message):
    model = tmp_path / "model"
    LcsmForCausalLM(LcsmConfig(lcsm=dict(mixer="gla", vocab_size=32, d_model=16, n_layers=1))).save_pretrained(model)
    (tmp_path / "empty").mkdir()
    names = {"{model}": str(model), "{bare}": str(model), "{empty}": str(tmp_path / "empty")}
    if "{model}" in args:
        byte_tokenizer().save_pretrained(model)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["eval-harness", *(names.get(a, a) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcsm eval-harness: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_an_unknown_task_is_named_after_looking_among_the_built_in_ones(tmp_path, no_built_in_tasks, capsys):
    out, _, _ = export(tmp_path, "byte", "gla")
    capsys.readouterr()
    assert main(["eval-harness", str(out), "--tasks", "lcsm_facts,no_such_task"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcsm eval-harness: error: unknown task(s) 'no_such_task'") and len(err.splitlines()) == 1
    assert no_built_in_tasks == [False, True]  # local tasks first, then the built-in ones
