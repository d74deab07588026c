"""The papers' own architectures as named presets: each is a ``ModelConfig``, nothing more.

    preset("etsmlp", task="listops")        ETSMLP (Chu 2024, section 3.2): CES inside an
                                            element-wise MLP, no channel mixer, bidirectional
    preset("etsmlp_gate", task="listops")   ETSMLP-Gate: the same block with the sigmoid gate
    preset("metala_transformer")            MetaLA Transformer (Chou et al. 2024, appendix A3.3):
                                            MetaLA token mixer + GLU, pre-norm; LM or LRA task
    preset("lcsm_lm")                       the LCSM WikiText-103 LM (LCSM section 3, Table 8)
    preset("lra_encoder", task="text",      any mixer as an LRA encoder (the baselines of ETSMLP
           mixer="s4d")                     Table 1): bidirectional, mean-pooled, pre-norm + GLU
    preset("samba")                         Samba (Ren et al. 2024): Mamba and sliding-window
                                            attention blocks alternating, each with its SwiGLU
    preset("jamba")                         Jamba (Lieber et al. 2024): one attention block per 8,
                                            Mamba the others
    preset("qwen3_next")                    Qwen3-Next-style: Gated DeltaNet, 3 : 1 attention

The hybrids take their size as ``d_model`` / ``n_layers`` (and the attention head width as
``head_dim``): published widths by default, any size for experiments.

Any field can be overridden: ``preset("etsmlp", task="text", d_model=32, n_layers=2)``; a head
mapping changes the fields it gives (``head={"hidden": 64}``), as the old flat spelling does.
Training recipes are run configs (``experiments/``), not presets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from lcsm._checks import check_int
from lcsm._names import did_you_mean

from .config import ModelConfig, layer_mixers, merge_model_values

# LRA inputs: byte-level text / pixels (256 symbols); ListOps: digits 0-9, four operators
# (MIN MAX MED SM), "[" "]" and padding (Nangia & Bowman 2018; Tay et al. 2020) -> 17 symbols.
LRA_INPUTS = {
    "listops": dict(vocab_size=17, head=dict(kind="classifier", n_classes=10)),
    "text": dict(vocab_size=256, head=dict(kind="classifier", n_classes=2)),
    "retrieval": dict(vocab_size=256, head=dict(kind="dual", n_classes=2)),
    "image": dict(vocab_size=256, head=dict(kind="classifier", n_classes=10)),
    "pathfinder": dict(vocab_size=256, head=dict(kind="classifier", n_classes=2)),
}

# ETSMLP LRA configurations (official configs, PKUAI-LINGroup/ETSMLP architectures/LRA_model.py,
# the smlp_*_complex architectures): embedding d, MLP
# hidden H, layers, ring r_min-r_max, max phase, norm (batch norm for the image tasks).
ETSMLP_LRA = {
    "listops": dict(
        d_model=160, mixer_hidden=160, n_layers=12, r_min=0.6, r_max=0.9, max_phase=2 * math.pi, norm="layernorm"
    ),
    "text": dict(d_model=160, mixer_hidden=160, n_layers=4, r_min=0.9, r_max=0.999, max_phase=0.314, norm="layernorm"),
    "retrieval": dict(
        d_model=160, mixer_hidden=160, n_layers=6, r_min=0.1, r_max=0.9, max_phase=math.pi, norm="layernorm"
    ),
    "image": dict(
        d_model=128, mixer_hidden=256, n_layers=8, r_min=0.9, r_max=0.99, max_phase=math.pi, norm="batchnorm"
    ),
    "pathfinder": dict(
        d_model=128, mixer_hidden=256, n_layers=6, r_min=0.9, r_max=0.9999, max_phase=0.314, norm="batchnorm"
    ),
}

# MetaLA LRA configurations (MetaLA Table A4): depth, d (d1 = d/2 is the mixer's query/decay
# width, fixed by the mixer), d2 = GLU hidden width, dropout.
METALA_LRA = {
    "listops": dict(n_layers=6, d_model=32, channel_hidden=64, dropout=0.0),
    "text": dict(n_layers=4, d_model=128, channel_hidden=256, dropout=0.1),
    "retrieval": dict(n_layers=2, d_model=256, channel_hidden=512, dropout=0.1),
    "image": dict(n_layers=6, d_model=512, channel_hidden=512, dropout=0.0),
    "pathfinder": dict(n_layers=6, d_model=128, channel_hidden=128, dropout=0.0),
}


def _task(task: str, table: dict) -> dict:
    if task not in table:
        raise ValueError(f"task: expected one of {', '.join(table)}, got {task!r}{did_you_mean(task, table)}")
    return dict(table[task])


def etsmlp(task: str = "listops", gate: bool = False, **overrides) -> ModelConfig:
    """ETSMLP (ETSMLP section 3.2, Figure 2): per block, X = LayerNorm(X_i), Z = W_2 relu(CES(W_1 X)),
    X_{i+1} = X_i + Z (gate: X_{i+1} = X_i + sigmoid(W_g X) * Z). No separate channel mixer.
    Encoder with CES's native bidirectional kernel (eq. 14). From the official code
    (PKUAI-LINGroup/ETSMLP ``architectures/LRA_model.py``, the complex "smlp" configs, and
    ``module/smlp_encoder.py``): a norm of the task's kind on the embeddings before the first
    block (``emb_layer_norm``), mean pooling ("mp"), dropout 0.1, no position embeddings, an output
    Linear without bias; no hidden classifier layer (classifier_layers 0) except for retrieval,
    whose two pooled vectors are concatenated, [u, v], and go through Linear(2d -> d) -> GELU
    (classifier_layers 1, classifier_out_dim = the embedding width 160). ``task`` picks the
    official LRA configuration. Runs made before ``embed_norm`` and ``head.mlp`` existed had
    neither (``embed_norm=False, head={"mlp": "lra", "hidden": 0}`` rebuild them)."""
    cfg = _task(task, ETSMLP_LRA)
    ring = {k: cfg.pop(k) for k in ("r_min", "r_max", "max_phase")}
    inputs = _task(task, LRA_INPUTS)
    values = dict(
        mixer="ces",
        mixer_options=dict(init="ring", **ring),
        mixer_activation="relu",
        channel_mixer="none",
        gate=gate,
        bidirectional=True,
        dropout=0.1,
        embed_norm=True,
        **cfg,
        vocab_size=inputs["vocab_size"],
        head=dict(inputs["head"], pooling="mean", combine="concat", mlp="etsmlp"),
    )
    if task == "retrieval":
        values["head"]["hidden"] = overrides.get("d_model", values["d_model"])
    return ModelConfig.from_dict(merge_model_values(values, overrides))


def etsmlp_gate(task: str = "listops", **overrides) -> ModelConfig:
    """ETSMLP-Gate (ETSMLP section 3.2, "Gated architecture"): ``etsmlp`` with the gate (an
    override ``gate=False`` gives ``etsmlp`` itself)."""
    return etsmlp(task, **{"gate": True, **overrides})


def metala_transformer(task: str | None = None, **overrides) -> ModelConfig:
    """MetaLA Transformer (MetaLA appendix A3.3, eq. A40-A43, Figure A1): pre-norm blocks of the
    MetaLA token mixer (eq. A31-A37) and a GLU channel mixer (eq. A41), XNorm = LayerNorm.

    task None: the causal LM at the official LM width (d = 1024, 8 heads of value width 128,
    conv 4; BICLab/MetaLA metala/modeling_metala.py) with 24 layers and the GPT-NeoX vocabulary (50277), the
    Pile setup of section 4; the paper does not state the depth of its 360M model, 24 layers at
    d = 1024 is the Pythia-410M shape it is compared with. task "listops" ... "pathfinder": the
    Table A4 LRA configuration, a bidirectional encoder (two causal MetaLA maps) with mean pooling.
    """
    if task is None:
        values = dict(
            mixer="metala",
            mixer_options=dict(heads=8, conv_size=4),
            d_model=1024,
            n_layers=24,
            vocab_size=50277,
            head=dict(kind="lm"),
            tie_embeddings=False,
            channel_mixer="glu",
            norm="layernorm",
        )
    else:
        cfg = _task(task, METALA_LRA)
        # Table A4 gives no head count: 2 heads as in the paper's own MQAR setup (appendix A4).
        values = dict(
            mixer="metala",
            mixer_options=dict(heads=2, conv_size=4),
            channel_mixer="glu",
            norm="layernorm",
            bidirectional=True,
            **cfg,
            vocab_size=LRA_INPUTS[task]["vocab_size"],
            head=dict(LRA_INPUTS[task]["head"], pooling="mean"),
        )
    return ModelConfig.from_dict(merge_model_values(values, overrides))


def lcsm_lm(**overrides) -> ModelConfig:
    """The LCSM language model of the WikiText-103 experiments (LCSM section 3; the Table 8
    training recipe heads ``experiments/lcsm_lm/base.yaml``). The paper gives only the recipe and
    the parameter count (43.45M in Tables 4-9); it follows Qin et al. 2023a (TNN), whose
    WikiText-103 decoders have 6 layers at d = 512 with a GLU channel mixer and tied embeddings over
    the 50265-token BPE vocabulary.
    With the best code 1-9-1-0, expand K = 64 and a GLU of width 3d this gives 43.6M parameters,
    within 0.5% of the paper's count; the exact block is not public (Doraemonzzz/Lcsm has the layer only)."""
    values = dict(
        mixer="lcsm",
        mixer_options=dict(code="1-9-1-0", expand=64),
        d_model=512,
        n_layers=6,
        vocab_size=50265,
        head=dict(kind="lm"),
        tie_embeddings=True,
        channel_mixer="glu",
        channel_hidden=1536,
        norm="layernorm",
    )
    values.update(overrides)
    return ModelConfig.from_dict(values)


def lra_encoder(task: str = "listops", mixer: str = "s4d", **overrides) -> ModelConfig:
    """An LRA encoder around any mixer, for the baselines of an LRA table (ETSMLP Table 1: S4,
    Transformer, ...): pre-LayerNorm blocks of the mixer and a GLU, bidirectional (two causal maps,
    or the mixer's own two-sided kernel), mean pooling over the valid positions, the task's LRA
    inputs. The papers' baselines each have their own LRA recipe (S4's, the LRA paper's
    Transformer); this is one common shape, so that a table compares mixers at equal width and
    depth. ``task`` takes the LRA inputs, the mixer and any field come from ``overrides``."""
    values = dict(
        mixer=mixer,
        channel_mixer="glu",
        norm="layernorm",
        bidirectional=True,
        d_model=128,
        n_layers=4,
        **_task(task, LRA_INPUTS),
    )
    values["head"] = dict(values["head"], pooling="mean")
    return ModelConfig.from_dict(merge_model_values(values, overrides))


def _heads(d_model: int, head_dim: int) -> int:
    """Attention heads of width ``head_dim`` at ``d_model`` (one head below it)."""
    check_int("head_dim", head_dim, 1)
    return max(1, d_model // head_dim)


def _attention_every(preset: str, n_layers: int, k: int, offset: int, overrides: Mapping[str, Any]) -> dict:
    """A hybrid preset's stack: attention at layers offset, offset + k, ..., the default mixer at
    the others. A depth that leaves no attention layer is refused by name (the preset's attention
    options would otherwise fail as options of a mixer the stack does not hold); a stack given in
    ``overrides`` is the caller's."""
    check_int("n_layers", n_layers, 1)
    check_int("every", k, 1)
    if "mixer" not in overrides and not 0 <= offset < min(k, n_layers):
        raise ValueError(
            f"{preset}: attention every {k} layers from layer {offset} needs 0 <= offset < every and "
            f"n_layers > offset, got n_layers={n_layers}, every={k}, offset={offset}"
        )
    return {"k": k, "mixer": "attention", "offset": offset}


def samba(d_model: int = 2304, n_layers: int = 18, window: int = 2048, head_dim: int = 128, **overrides) -> ModelConfig:
    """Samba (Ren et al. 2024, "Samba: Simple Hybrid State Space Models for Efficient Unlimited
    Context Language Modeling", section 2): Mamba, MLP, SWA, MLP repeated. As the official code
    builds it (microsoft/Samba ``lit_gpt/model.py`` Block and ``lit_gpt/config.py``, commit
    19845f41): block i is pre-RMSNorm, its mixer (Mamba where i % 2 == 0, sliding-window attention
    otherwise) and a SwiGLU MLP, the attention with RoPE over the whole head, window 2048, heads of
    width 128, no biases, tied embeddings, vocabulary 32000. Defaults: the official
    ``Samba_1.3B`` (d 2304, 18 blocks, 18 heads, MLP width 6144 = lcsm's 8d/3); ``Samba_421M`` is
    ``d_model=1536, n_layers=12``. Departure: no grouped-query option (the official models use full
    multi-head attention too; its GQA variants are ablations)."""
    values = dict(
        mixer={"default": "mamba", "every": _attention_every("samba", n_layers, 2, 1, overrides)},
        mixer_options=dict(
            attention=dict(heads=_heads(d_model, head_dim), positions="rotary", window=window, bias=False)
        ),
        d_model=d_model,
        n_layers=n_layers,
        vocab_size=32000,
        head=dict(kind="lm"),
        channel_mixer="glu",
        norm="rmsnorm",
    )
    return ModelConfig.from_dict(merge_model_values(values, overrides))


def jamba(
    d_model: int = 4096,
    n_layers: int = 32,
    every: int = 8,
    offset: int | None = None,
    head_dim: int = 128,
    **overrides,
) -> ModelConfig:
    """Jamba (Lieber et al. 2024, "Jamba: A Hybrid Transformer-Mamba Language Model": blocks of
    l = 8 layers, a : m = 1 : 7): in each group of ``every`` = 8 layers one attention layer (at
    ``offset``, default every // 2: 4, the released model's ``attn_layer_offset``) and Mamba in the
    others;
    attention without positional information (the paper finds Mamba gives the order), RMSNorm,
    SwiGLU MLPs; d 4096, 32 layers, vocabulary 65536, untied head (the values of transformers'
    ``JambaConfig``, 5.24: attn_layer_period 8, attn_layer_offset 4). The Nemotron-H / Bamba form
    is the same mix with Mamba-2 layers (``every``/``offset`` give its ratio). Departures: lcsm's
    ``mamba`` is Mamba-1 (Jamba's own; Mamba-2 for Nemotron-H once ``mamba2`` is registered, pass
    ``mixer=`` a pattern with it), dense MLPs in place of Jamba's mixture of experts (every other
    layer), and no grouped-query attention."""
    values = dict(
        mixer={
            "default": "mamba",
            "every": _attention_every("jamba", n_layers, every, every // 2 if offset is None else offset, overrides),
        },
        mixer_options=dict(attention=dict(heads=_heads(d_model, head_dim), positions="none", bias=False)),
        d_model=d_model,
        n_layers=n_layers,
        vocab_size=65536,
        head=dict(kind="lm"),
        tie_embeddings=False,
        channel_mixer="glu",
        norm="rmsnorm",
    )
    return ModelConfig.from_dict(merge_model_values(values, overrides))


def qwen3_next(d_model: int = 2048, n_layers: int = 48, head_dim: int = 256, **overrides) -> ModelConfig:
    """A Qwen3-Next-style stack (Qwen team 2025, Qwen3-Next model card and ``qwen3_next`` in
    transformers; Gated DeltaNet: Yang et al. 2025, ICLR): three Gated DeltaNet layers, then one
    attention layer (layers 3, 7, ...), RMSNorm, SwiGLU, rotary attention of head width 256;
    hidden 2048, 48 layers, vocabulary 151936, untied head (transformers' ``Qwen3NextConfig``, 5.24:
    full attention where (layer + 1) % 4 == 0). Departures: plain softmax attention (Qwen3-Next gates its output,
    rotates a quarter of each head only, and has 16 query heads of 256 = 2d with 2 key/value heads;
    here d / 256 heads), dense MLPs in place of its mixture of experts."""
    values = dict(
        mixer={"default": "gated_deltanet", "every": _attention_every("qwen3_next", n_layers, 4, 3, overrides)},
        mixer_options=dict(attention=dict(heads=_heads(d_model, head_dim), positions="rotary", bias=False)),
        d_model=d_model,
        n_layers=n_layers,
        vocab_size=151936,
        head=dict(kind="lm"),
        tie_embeddings=False,
        channel_mixer="glu",
        norm="rmsnorm",
    )
    return ModelConfig.from_dict(merge_model_values(values, overrides))


# Bumped when a preset comes to build another model for the same arguments (as Mixer.revision).
# etsmlp 2: the official embedding norm and LRA classifier (embed_norm, head.mlp="etsmlp").
PRESET_REVISIONS: dict[str, int] = {"etsmlp": 2, "etsmlp_gate": 2}


def model_revisions(model: Mapping[str, Any], preset_name: str | None = None) -> dict[str, int]:
    """The revisions of what a model config builds: ``{"mixer:<name>": n}`` for its mixer (with the
    options its name implies) and ``{"preset:<name>": n}`` for its preset. ``model`` is the merged
    model keys (preset fields, then the given ones) as ``RunConfig.model_keys`` returns them."""
    from lcsm.layers.base import resolve

    revisions = {}
    mixer = model.get("mixer", ModelConfig.mixer)
    if isinstance(mixer, str):
        cls, implied = resolve(mixer)
        revisions[f"mixer:{cls.registry_name}"] = cls.revision_for({**implied, **(model.get("mixer_options") or {})})
    else:
        # A hybrid: each mixer of the stack, at the highest revision its layers' options build.
        n_layers = model.get("n_layers", ModelConfig.n_layers)
        for name, options in layer_mixers(mixer, model.get("mixer_options") or {}, n_layers):
            cls, implied = resolve(name)
            key = f"mixer:{cls.registry_name}"
            revisions[key] = max(revisions.get(key, 0), cls.revision_for({**implied, **options}))
    if preset_name is not None:
        revisions[f"preset:{preset_name}"] = PRESET_REVISIONS.get(preset_name, 1)
    return revisions


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "etsmlp": etsmlp,
    "etsmlp_gate": etsmlp_gate,
    "metala_transformer": metala_transformer,
    "lcsm_lm": lcsm_lm,
    "lra_encoder": lra_encoder,
    "samba": samba,
    "jamba": jamba,
    "qwen3_next": qwen3_next,
}


def preset(name: str, **kwargs) -> ModelConfig:
    """The config of a named preset, with ``kwargs`` (``task`` and/or any ModelConfig field) applied."""
    if name not in PRESETS:
        raise ValueError(
            f"preset: unknown name {name!r}{did_you_mean(name, PRESETS)}. Valid presets: {', '.join(PRESETS)}"
        )
    return PRESETS[name](**kwargs)
