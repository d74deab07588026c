"""lcsm train / eval / generate: exit 0 on valid input, one clear line and exit 2 on bad input."""

import json
import re
import shutil

import pytest
import torch
import yaml

from lcsm.cli import main

from .conftest import TINY


@pytest.fixture
def run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--set", "train.max_steps=4"]) == 0
    out, err = capsys.readouterr()
    assert "final test metrics" in out and "accuracy" in out
    assert "step 4/4" in err and "done: completed at step 4" in err
    return tmp_path / "run"


def test_train_eval_generate(run_dir, capsys):
    assert main(["eval", str(run_dir), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["split"] == "test" and set(record["metrics"]) >= {"loss", "accuracy"}
    assert main(["eval", str(run_dir), "--best"]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert (
        main(["generate", str(run_dir), "--prompt-ids", "3 20 5", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    )
    tokens = capsys.readouterr().out.split()
    assert len(tokens) == 4 and all(0 <= int(t) < 32 for t in tokens)


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "/nonexistent/run"], "no such file or directory"),
        (["generate", "{run}", "--prompt", "hello"], "has no text tokenizer"),
        (["generate", "{run}", "--prompt-ids", "3 x"], "--prompt-ids: expected integers"),
        (["generate", "{run}", "--prompt-ids", "99"], "ids must lie in [0, 32)"),
        (["generate", "{run}"], "exactly one of --prompt"),
        (["generate", "{run}", "--prompt-ids", "3", "--max-new-tokens", "0"], "--max-new-tokens: expected a positive"),
        (["generate", "{run}", "--prompt-ids", "3", "--top-k", "0"], "--top-k: expected None or a positive integer"),
        (["eval", "{run}", "--split", "dev"], "--split: task 'mqar' has splits"),
        (["eval", "{run}", "--device", "gpu"], "--device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        (["generate", "{run}", "--prompt-ids", "3", "--device", "gpu"], "--device: expected 'auto', 'cpu', 'cuda'"),
        pytest.param(
            ["eval", "{run}", "--device", "cuda"],
            "--device: 'cuda' requested but CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
        (["eval", "{run}", "--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
        (["generate", "{run}", "--prompt-ids", "3", "--seed", str(2**64)], "--seed: expected an integer in [0, 2**63)"),
        (["eval", "{run}/checkpoints/step-00000004", "--best"], "is a checkpoint directory; --best picks a run's"),
    ],
)
def test_user_errors_are_one_line(run_dir, capsys, args, message):
    assert main([a.replace("{run}", str(run_dir)) for a in args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_incompatible_checkpoint(run_dir, capsys):
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    info = json.loads((ckpt / "run.json").read_text())
    info["config"]["model"]["d_model"] = 32
    (ckpt / "run.json").write_text(json.dumps(info))
    assert main(["eval", str(ckpt)]) == 2
    assert "weights do not fit the model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("task: [unclosed", "not valid YAML"),
        (b"\xff\xfetask: {}", "bad.yaml': not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"),
        ("- a list", "expected a mapping at the top level"),
        ("task: {name: mqar}\nmodel: {}\ntask: {name: lm}\n", "the key 'task' is given twice"),
        ("name: e\nbase: tiny.yaml\ngrid: {model.mixer: [gla]}\n", "an experiment file (it has base, grid)"),
        (yaml.safe_dump({**TINY, "modle": {}}), "unknown key(s) 'modle' (did you mean 'model'?)"),
        (yaml.safe_dump({**TINY, "model": {"mixer": "glaa"}}), "unknown mixer 'glaa'. Did you mean gla?"),
    ],
)
def test_bad_configs(tmp_path, capsys, content, message):
    cfg = tmp_path / "bad.yaml"
    if isinstance(content, bytes):
        cfg.write_bytes(content)
    elif content is not None:
        cfg.write_text(content)
    assert main(["train", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcsm train: error: ") and message in err


def test_generate_samples_the_task_ids_of_a_larger_model_vocabulary(tmp_path, monkeypatch, capsys):
    """A model vocabulary above the task's (padding rows) must not leak into the samples."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    run = str(tmp_path / "big")
    assert main(["train", str(tmp_path / "tiny.yaml"), "--out", run, "--set", "model.vocab_size=4096", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["generate", run, "--prompt-ids", "3 20 5", "--max-new-tokens", "16"]) == 0
    tokens = [int(t) for t in capsys.readouterr().out.split()]
    assert len(tokens) == 16 and max(tokens) < 32


@pytest.mark.parametrize("out", ["run #2", "20240101"])
def test_out_is_a_path_as_given(tmp_path, monkeypatch, capsys, out):
    """Not YAML: '#' would start a comment, digits would make a number."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    assert main(["train", "tiny.yaml", "--out", out, "--set", "train.max_steps=1", "--quiet"]) == 0
    assert json.loads((tmp_path / out / "result.json").read_text())["config"]["out_dir"] == out


def test_help_on_every_command(capsys):
    for command in ("train", "eval", "generate", "sweep", "report", "list", "bench"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert "usage: lcsm" in capsys.readouterr().out


# The model-level names of the head's fields before the head was nested.
FLAT_NAMES = {
    "kind": "head",
    "n_classes": "n_classes",
    "pooling": "pooling",
    "hidden": "head_hidden",
    "combine": "dual_combine",
    "mlp": "head_mlp",
}


def _with_flat_head(checkpoint, model: dict) -> None:
    """Rewrite a checkpoint's run.json as lcsm wrote it before the head was nested: ``model``
    given flat in the run config, and the model config recorded with the flat head fields."""
    info = json.loads((checkpoint / "run.json").read_text())
    info["config"]["model"] = model
    recorded = dict(info["model_config"])
    recorded |= {FLAT_NAMES[k]: v for k, v in recorded.pop("head").items()}
    info["model_config"] = recorded
    (checkpoint / "run.json").write_text(json.dumps(info))


def test_a_checkpoint_with_the_old_flat_head_loads(run_dir, capsys):
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert main(["eval", str(ckpt), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)["metrics"]
    _with_flat_head(ckpt, {**TINY["model"], "head": "lm"})
    assert main(["eval", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == before
    assert main(["generate", str(ckpt), "--prompt-ids", "3 20 5", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert len(capsys.readouterr().out.split()) == 4


def test_a_classifier_checkpoint_with_the_old_flat_head_loads(tmp_path, monkeypatch, capsys):
    """A classifier's head fields written flat (head_hidden, pooling) rebuild the same head."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    listops = {"name": "listops", "max_length": 24, "min_length": 8, "train_examples": 32, "test_examples": 16}
    model = {**TINY["model"], "bidirectional": True, "head": {"hidden": 8, "pooling": "last"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**TINY, "task": listops, "model": model}))
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)["metrics"]
    flat = {**TINY["model"], "bidirectional": True, "head": "classifier", "head_hidden": 8, "pooling": "last"}
    _with_flat_head(ckpt, flat)
    assert main(["eval", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == before


@pytest.mark.parametrize("target", ["run", "run/config.yaml"])
def test_a_run_directory_or_its_config_resumes_that_run_from_anywhere(tmp_path, monkeypatch, capsys, target):
    """The config.yaml a run writes records out_dir as given (here relative): from another working
    directory, `lcsm train RUN` or `lcsm train RUN/config.yaml` continues RUN, not a new run."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    assert main(["train", "tiny.yaml", "--out", "run", "--set", "train.max_steps=4"]) == 0
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["out_dir"] == "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["train", f"../{target}"]) == 0
    assert "finished already (completed at step 4)" in capsys.readouterr().err
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("target", ["run", "run/config.yaml"])
def test_a_run_killed_before_its_first_checkpoint_resumes_in_its_own_directory(tmp_path, monkeypatch, capsys, target):
    """A run dead before any checkpoint leaves config.yaml, metrics.jsonl and its lock: from another
    working directory it trains there again, not into a new run beside the caller (it did)."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    assert main(["train", "tiny.yaml", "--out", "run", "--set", "train.max_steps=4"]) == 0
    for written in ("checkpoints", "result.json", "eval.csv", "train.csv"):
        path = tmp_path / "run" / written
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", f"../{target}"]) == 0
    assert not list(elsewhere.iterdir()) and (tmp_path / "run" / "result.json").is_file()


@pytest.mark.parametrize("target", ["sweep/run=a", "sweep/run=a/config.yaml"])
def test_a_run_stopped_before_its_lock_resumes_in_its_own_directory(tmp_path, monkeypatch, target):
    """A sweep's run that failed as it started leaves its config.yaml alone (out_dir as the sweep
    gave it, relative to the sweep's working directory): from elsewhere it trains there, not into
    a new run beside the caller (it did)."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "sweep" / "run=a"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({**TINY, "out_dir": "sweep/run=a"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", str(tmp_path / target), "--set", "train.max_steps=2", "--quiet"]) == 0
    assert not list(elsewhere.iterdir()) and (run / "result.json").is_file()


def test_a_directory_of_a_hand_written_config_trains_into_its_out_dir(tmp_path, monkeypatch):
    """Not a run directory (nothing a run wrote): the config's own out_dir, as for its file."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "config.yaml").write_text(yaml.safe_dump({**TINY, "out_dir": "runs/mine"}))
    assert main(["train", "configs", "--set", "train.max_steps=2"]) == 0
    assert (tmp_path / "runs" / "mine" / "result.json").is_file()
    assert not (tmp_path / "configs" / "result.json").exists()


def test_a_finished_result_with_a_nan_metric_prints_again_and_eval_json_is_strict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "tiny.yaml"), "--out", str(run), "--set", "train.max_steps=4"]) == 0
    result = json.loads((run / "result.json").read_text())
    result["metrics"]["loss"] = None  # a nan as result.json stores it
    (run / "result.json").write_text(json.dumps(result))
    capsys.readouterr()
    assert main(["train", str(run)]) == 0
    assert re.search(r"loss\s+nan", capsys.readouterr().out)
    monkeypatch.setattr("lcsm.engine.evaluate", lambda *a, **k: {"loss": float("nan"), "accuracy": 0.5})
    assert main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == {"loss": None, "accuracy": 0.5}


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_model=0", "model.d_model: expected an integer >= 1"),
        ("task.train_examples=0", "task.train_examples: expected an integer >= 1"),
        ("model.mixer_options.expand_k=0", "model.mixer_options.expand_k: expected a positive"),
        ("train.seed=20000000000000", "train.seed: expected an integer in [0, 2**32)"),
    ],
)
def test_errors_name_the_key_as_the_config_spells_it(tmp_path, monkeypatch, capsys, override, message):
    """A section's builder names its own field; the run config's error gives the full dotted key,
    the mixer's options (checked when the mixer is built) included."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--set", override]) == 2
    assert f"lcsm train: error: {message}" in capsys.readouterr().err


def test_a_directory_that_holds_no_run_is_refused(tmp_path, capsys):
    assert main(["train", str(tmp_path)]) == 2
    assert "a directory without config.yaml" in capsys.readouterr().err


def test_generated_text_is_shown_as_it_comes_whole_characters_only(capsys):
    """A character split over tokens (UTF-8 bytes) is printed once its last token arrives; what
    was shown stays shown when the generation stops early."""
    from lcsm.cli.train import _Shown
    from lcsm.tasks.lm import ByteTokenizer

    class Task:
        decode = staticmethod(ByteTokenizer().decode)

    show = _Shown(Task())
    show.text(list(b"a "))
    first, second = "é".encode()
    show.token(first)
    assert capsys.readouterr().out == "a "
    show.token(second)
    show.token(ord("b"))
    assert capsys.readouterr().out == "éb"
    show.end()
    assert capsys.readouterr().out == "\n"


def test_ids_are_shown_as_they_come_without_a_tokenizer(capsys):
    from lcsm.cli.train import _Shown
    from lcsm.tasks import build

    show = _Shown(build("mqar", train_examples=4, test_examples=4))
    show.text([1, 2])
    for token in (5, 7):
        show.token(token)
    show.end()
    assert capsys.readouterr().out == "5 7\n"
