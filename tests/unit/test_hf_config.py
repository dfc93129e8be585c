"""config.json checks (dpserve_engine.hf_config): what the model computes exactly is read in both transformers 4 and 5
shapes; what it does not (Qwen3's q/k norms, Gemma 2's softcaps, a rope scaling, another activation) is refused by
name, never loaded as a near miss."""

import pytest

from dpserve_engine.hf_config import check_hf_config

LLAMA = {"model_type": "llama", "hidden_act": "silu", "max_position_embeddings": 8192, "rope_theta": 500000.0}


def test_a_plain_llama_config_gives_its_theta_and_context():
    got = check_hf_config(LLAMA, "m")
    assert (got.rope_theta, got.context_length) == (500000.0, 8192)


def test_no_theta_is_llamas_default():
    assert check_hf_config({"model_type": "llama"}, "m").rope_theta == 10000.0


def test_transformers_5_rope_parameters_give_the_theta():
    cfg = {"model_type": "qwen2", "max_position_embeddings": 32768,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip
    assert check_hf_config(cfg, "m").rope_theta == 1000000.0


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "phi3", "qwen3_moe", None])
def test_a_model_type_the_model_does_not_compute_is_refused_by_name(model_type):
    with pytest.raises(ValueError, match=rf"m: model_type {model_type!r} .*not supported"):
        check_hf_config({"model_type": model_type}, "m")


def test_an_old_config_without_model_type_is_read_from_its_architectures():
    cfg = {"architectures": ["MixtralForCausalLM"], "rope_theta": 1e6}
    assert check_hf_config(cfg, "m").rope_theta == 1e6


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn", "longrope"])
def test_a_rope_scaling_is_refused_in_either_shape(key, kind):
    cfg = dict(LLAMA, **{key: {"rope_type": kind, "factor": 8.0, "rope_theta": 500000.0}})
    with pytest.raises(ValueError, match=rf"{key} of type '{kind}' is not supported"):
        check_hf_config(cfg, "m")


def test_the_old_type_key_of_rope_scaling_is_read_too():
    with pytest.raises(ValueError, match="rope_scaling of type 'dynamic'"):
        check_hf_config(dict(LLAMA, rope_scaling={"type": "dynamic", "factor": 2.0}), "m")


def test_default_rope_scaling_is_plain_rope():
    assert check_hf_config(dict(LLAMA, rope_scaling={"rope_type": "default"}), "m").rope_theta == 500000.0


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
])  # fmt: skip
def test_other_options_the_block_lacks_are_refused_by_name(change, field):
    with pytest.raises(ValueError, match=field):
        check_hf_config(dict(LLAMA, **change), "m")


def test_a_sliding_window_in_use_caps_the_context_at_the_window():
    mistral = {"model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    assert check_hf_config(mistral, "m").context_length == 4096
    qwen2_off = {"model_type": "qwen2", "max_position_embeddings": 32768, "sliding_window": 4096,
                 "use_sliding_window": False}  # fmt: skip
    assert check_hf_config(qwen2_off, "m").context_length == 32768
    wider = dict(mistral, sliding_window=65536)
    assert check_hf_config(wider, "m").context_length == 32768
