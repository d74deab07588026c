"""run.compile (``train.compile`` in a config is read as it): the training step through
torch.compile trains like the eager step, up to rounding."""

import pytest

from lcsm.engine import RunConfig, train
from lcsm.testing import assert_close

from .test_train import config, train_log, weights


@pytest.mark.slow  # about 60 s on 2 busy cores
def test_compiled_steps_train_like_eager(cache_env):
    """Two optimizer steps of the tiny GLA model with two layers (two decayed kernels in one graph)
    and a batch equal to its head count (one size symbol for both): the same logged losses and
    gradient norms and the same weights. Backend aot_eager: it traces forward and backward as
    inductor does, without inductor's code generation, which would take minutes here
    (docs/compile.md)."""
    common = {
        "model.n_layers": 2,
        "model.mixer_options": {"num_heads": 4},
        "train.batch_size": 4,
        "train.max_steps": 2,
        "train.eval_every": 0,
        "train.save_every": 0,
        "run.log_every": 1,
    }
    train(config(cache_env, "eager", **common), quiet=True)
    compiled = config(cache_env, "compiled", **common, **{"train.compile": "aot_eager"})
    assert compiled.run.compile == "aot_eager"
    train(compiled, quiet=True)
    assert_close(weights(cache_env / "compiled"), weights(cache_env / "eager"), context="compiled vs eager")
    assert_close(
        {k: train_log(cache_env / "compiled", k) for k in ("loss", "grad_norm")},
        {k: train_log(cache_env / "eager", k) for k in ("loss", "grad_norm")},
        context="compiled vs eager logs",
    )


@pytest.mark.parametrize("value", ["yes", "cudagraphs", 1, None])
def test_compile_option_is_validated(tmp_path, value):
    with pytest.raises(ValueError, match="run.compile: expected true, false or a backend"):
        config(tmp_path, **{"run.compile": value})


def test_compile_true_is_inductor(tmp_path):
    assert config(tmp_path, **{"run.compile": True}).run.compile_backend == "inductor"
    assert config(tmp_path).run.compile_backend is None
    assert isinstance(config(tmp_path), RunConfig)
