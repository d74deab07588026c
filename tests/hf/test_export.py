"""lcsm export RUN_DIR --hf OUT_DIR: a four-step run (mqar ids, lm bytes, lm BPE) exported, loaded
by AutoModelForCausalLM after ``import lcsm.hf``, generating as lcsm's own model."""

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (lcsm's 'hf' extra: pip install -e '.[hf]')")

import torch
import yaml
from cli.conftest import TINY  # tests/ is on sys.path (pytest inserts the base of the test packages)
from transformers import AutoModelForCausalLM, AutoTokenizer

import lcsm.hf  # noqa: F401  (registers model_type "lcsm")
from lcsm.cli import main
from lcsm.engine import load_run
from lcsm.hf import LcsmForCausalLM
from lcsm.tasks.lm import ByteTokenizer

TEXT = "The whale, the sea and the ship. Ahab's voice: all hands! Ünïcödé é 🐋.\n"


def train(tmp_path, monkeypatch, task) -> str:
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "task": task}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 0
    return str(run)


@pytest.fixture
def mqar_run(tmp_path, monkeypatch):
    return train(tmp_path, monkeypatch, TINY["task"])


def lm_task(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i:02d}.txt").write_text(TEXT * 3 + f"[doc {i}]\n")
    return {"name": "lm", "corpus": f"path:{corpus}", "tokenizer": tokenizer, "bpe_vocab": 300, "seq_len": 16}


def check_generates_as_lcsm(run, out):
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(hf, LcsmForCausalLM)
    _, task, model, _ = load_run(run)
    theirs, ours = hf.model.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    ids = torch.tensor([[3, 7, 5, 2]])
    new = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[:, 4:]
    assert torch.equal(new, model.generate(ids, max_new_tokens=6, temperature=0, vocab_size=task.vocab_size))


def test_export_mqar_run_without_tokenizer(mqar_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", mqar_run, "--hf", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "exported" in printed and "no tokenizer: task 'mqar' reads token ids" in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    check_generates_as_lcsm(mqar_run, out)
    # --best exports the best checkpoint (into an existing empty directory)
    best = tmp_path / "best"
    best.mkdir()
    assert main(["export", mqar_run, "--hf", str(best), "--best"]) == 0
    assert "checkpoints/best" in capsys.readouterr().out


def test_padding_rows_of_the_vocabulary_are_never_generated(tmp_path, monkeypatch):
    monkeypatch.setitem(TINY, "model", {**TINY["model"], "vocab_size": 40})  # the task has 32 ids
    run = train(tmp_path, monkeypatch, TINY["task"])
    out = tmp_path / "hf"
    assert main(["export", run, "--hf", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.vocab_size == 40 and hf.generation_config.suppress_tokens == list(range(32, 40))
    check_generates_as_lcsm(run, out)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_export_lm_run_with_its_tokenizer(tmp_path, monkeypatch, capsys, tokenizer):
    run = train(tmp_path, monkeypatch, lm_task(tmp_path, tokenizer))
    out = tmp_path / "hf"
    assert main(["export", run, "--hf", str(out)]) == 0
    assert "as PreTrainedTokenizerFast" in capsys.readouterr().out
    check_generates_as_lcsm(run, out)
    hf_tok = AutoTokenizer.from_pretrained(out)
    _, task, _, _ = load_run(run)
    ids = hf_tok(TEXT)["input_ids"]
    assert ids == task.encode(TEXT)
    assert hf_tok.decode(ids) == TEXT == task.decode(ids)
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == task.tokenizer.eod
    assert AutoModelForCausalLM.from_pretrained(out).config.eos_token_id == task.tokenizer.eod
    literal = "a<|endoftext|>b"  # a document's own text: text to both, not end-of-document
    assert hf_tok(literal)["input_ids"] == task.encode(literal) and task.tokenizer.eod not in task.encode(literal)
    if tokenizer == "byte":
        assert len(hf_tok) == ByteTokenizer.vocab_size
        assert hf_tok(bytes(range(128)).decode())["input_ids"] == list(range(128))


def test_a_niah_model_gets_the_byte_tokenizer():
    from lcsm import tasks
    from lcsm.hf.export import task_tokenizer

    tok = task_tokenizer(tasks.build("niah", use_cache=False))
    assert tok is not None and tok.eos_token_id == ByteTokenizer.eod and tok("Ahab")["input_ids"] == list(b"Ahab")


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "/nonexistent/run", "--hf", "{tmp}/out"], "no such file or directory"),
        (["export", "{run}", "--hf", "{run}"], "exists and is not an empty directory"),
        (["export", "{run}", "--hf", "{run}/config.yaml"], "config.yaml' is a file; give a new or empty directory"),
    ],
)
def test_user_errors_are_one_line(mqar_run, tmp_path, capsys, args, message):
    capsys.readouterr()
    assert main([a.replace("{run}", mqar_run).replace("{tmp}", str(tmp_path)) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcsm export: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_export_needs_hf(capsys):
    with pytest.raises(SystemExit):
        main(["export", "run"])
    assert "--hf" in capsys.readouterr().err


def test_a_classifier_run_is_refused(tmp_path, monkeypatch, capsys):
    task = {"name": "listops", "train_examples": 16, "validation_examples": 8, "test_examples": 8}
    run = train(tmp_path, monkeypatch, {**task, "min_length": 16, "max_length": 32})
    assert main(["export", run, "--hf", str(tmp_path / "out")]) == 2
    assert "the Hugging Face export is for language models" in capsys.readouterr().err
