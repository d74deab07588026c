"""A trained run as a Hugging Face directory (``lcsm export RUN_DIR --hf OUT_DIR``).

    OUT_DIR/config.json, model.safetensors, generation_config.json   the model (LcsmForCausalLM)
    OUT_DIR/tokenizer.json, tokenizer_config.json, ...               the task's tokenizer, if it has one

The weights come from the run's newest intact checkpoint (or its best one), through the engine's
``load_run`` (which passes over damaged checkpoints, saying so). The lm task's tokenizers become
``PreTrainedTokenizerFast``s: its BPE as it is (a ``tokenizers`` byte-level BPE already), its byte
tokenizer as a byte-level vocabulary of 256 single-byte tokens, id = byte value, with no merges,
plus end-of-document (256). A task of token ids (mqar) has no tokenizer to export.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from lcsm.models import CausalLM
from lcsm.tasks.lm import EOD, BPETokenizer, ByteTokenizer

from .configuration import LcsmConfig
from .modeling import LcsmForCausalLM


def byte_level_characters() -> list[str]:
    """The character standing for each byte 0-255 in byte-level BPE vocabularies (GPT-2's scheme, which
    ``tokenizers``' ByteLevel pre-tokenizer applies): printable Latin-1 bytes stand for themselves, the
    others, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The lm task's byte tokenizer (UTF-8 bytes 0-255, end-of-document 256) as a fast tokenizer:
    a BPE model without merges over the 256 byte characters, so each byte is its own token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(byte_level_characters())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the byte stream is exactly the text's UTF-8, as lcsm's.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD, special=True)])
    if tok.token_to_id(EOD) != ByteTokenizer.eod:
        raise AssertionError(f"byte tokenizer: end-of-document got id {tok.token_to_id(EOD)}, expected 256")
    return _fast(tok)


def _fast(tok) -> PreTrainedTokenizerFast:
    """``tok`` as a transformers tokenizer with end-of-document as its eos token. A text's own
    "<|endoftext|>" is text (split_special_tokens), as the lm task's tokenizers read it."""
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD, split_special_tokens=True)


def task_tokenizer(task) -> PreTrainedTokenizerFast | None:
    """The task's tokenizer as a transformers one, or None for a task of token ids."""
    tokenizer = getattr(task, "tokenizer", None)
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer()
    if isinstance(tokenizer, BPETokenizer):
        return _fast(tokenizer.tok)
    return None


def export_run(
    run_dir: str | Path, out_dir: str | Path, *, best: bool = False, note: Callable[[str], None] = print
) -> Path:
    """Write the run's model (newest intact checkpoint, or ``best``) and tokenizer to ``out_dir``,
    which must not exist or be empty. Written into a temporary directory next to it first, then
    renamed into place, so a failed export leaves nothing behind."""
    from lcsm.engine import load_run

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--hf: {str(out_dir)!r} is a file; give a new or empty directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"--hf: {str(out_dir)!r} exists and is not an empty directory; remove it or choose another")
    _, task, model, checkpoint = load_run(run_dir, which="best" if best else "last")
    if not isinstance(model, CausalLM):
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds a {model.config.head.kind!r} model; the Hugging Face export "
            "is for language models (head 'lm')"
        )
    tokenizer = task_tokenizer(task)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    hf = LcsmForCausalLM(LcsmConfig(lcsm=model.config, eos_token_id=eos))
    hf.model.load_state_dict(model.state_dict())
    if hf.config.vocab_size > task.vocab_size:
        # Rows past the task's vocabulary are padding the engine allows, never trained as targets:
        # generate never samples them (as lcsm's generate with the task's vocab_size).
        hf.generation_config.suppress_tokens = list(range(task.vocab_size, hf.config.vocab_size))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        hf.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    note(f"exported {checkpoint} to {out_dir} (LcsmForCausalLM, {hf.config.lcsm['mixer']})")
    if tokenizer is None:
        note(f"no tokenizer: task {task.registry_name!r} reads token ids")
    else:
        note(f"tokenizer: {type(task.tokenizer).__name__} as PreTrainedTokenizerFast ({len(tokenizer)} tokens)")
    return out_dir
