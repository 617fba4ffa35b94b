"""The bundled script's reading of a GPT-2 ``config.json`` (``entrypoints.gpt.config_from_hf_gpt2``): every value
type-checked, every problem named with its key, its value and what would work, all of them at once."""

from __future__ import annotations

import math

import pytest

from entrypoints.gpt import GPTConfig, config_from_hf_gpt2

GOOD = {"model_type": "gpt2", "vocab_size": 300, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}


def _refused(**changes) -> str:
    with pytest.raises(ValueError) as refused:
        config_from_hf_gpt2({**GOOD, **changes})
    return str(refused.value)


def test_a_good_config_gives_its_gpt():
    config = config_from_hf_gpt2({**GOOD, "tie_word_embeddings": False, "n_inner": 128})
    assert (config.vocab_size, config.block_size, config.d_model, config.n_layer, config.n_head) == (300, 64, 32, 2, 4)
    assert config.tie_embeddings is False
    assert config_from_hf_gpt2(GOOD).tie_embeddings is True  # transformers' default


@pytest.mark.parametrize(
    "key, value",
    [
        ("n_layer", "2"),
        ("n_layer", None),
        ("n_layer", 2.5),
        ("n_layer", True),
        ("n_embd", 64.0),
        ("n_positions", math.nan),
        ("vocab_size", math.inf),
        ("n_head", [4]),
    ],
)
def test_a_value_that_is_not_an_integer_is_refused_naming_key_and_value(key, value):
    message = _refused(**{key: value})
    assert f"{key}={value!r}" in message and "must be a positive integer" in message, message


@pytest.mark.parametrize("key", ["n_layer", "n_head", "n_embd", "n_positions", "vocab_size"])
def test_zero_and_negative_sizes_are_refused(key):
    for value in (0, -3):
        message = _refused(**{key: value})
        assert f"{key}={value}" in message and "must be a positive integer" in message, message


def test_n_head_zero_is_a_clear_error_not_a_division_by_zero():
    assert "n_head=0" in _refused(n_head=0)


def test_n_embd_not_divisible_by_n_head_names_both_and_what_would_divide():
    message = _refused(n_embd=30, n_head=4)
    assert "n_embd=30 is not divisible by n_head=4" in message and "1, 2, 3, 5, 6, 10, 15, 30" in message, message


@pytest.mark.parametrize("value", ["false", 0, 1, None, "true"])
def test_tie_word_embeddings_must_be_a_json_boolean(value):
    message = _refused(tie_word_embeddings=value)
    assert f"tie_word_embeddings={value!r}" in message and "true or false" in message, message


@pytest.mark.parametrize(
    "key, value", [("scale_attn_weights", 1), ("scale_attn_by_inverse_layer_idx", 0), ("add_cross_attention", 0)]
)
def test_the_boolean_settings_are_booleans_not_numbers_equal_to_one(key, value):
    assert f"{key}={value} must be true or false" in _refused(**{key: value})


def test_n_inner_is_null_or_four_times_n_embd_as_an_integer():
    assert "n_inner=128.0" in _refused(n_inner=128.0)
    assert "n_inner=100" in _refused(n_inner=100)


def test_every_problem_is_reported_at_once():
    message = _refused(n_layer="2", n_head=0, tie_word_embeddings="false")
    for part in ("n_layer='2'", "n_head=0", "tie_word_embeddings='false'"):
        assert part in message, message


def test_the_gpt_config_itself_refuses_what_the_script_would_trip_on():
    with pytest.raises(ValueError, match=r"n_head=0 must be a positive integer"):
        GPTConfig(n_head=0)
    with pytest.raises(ValueError, match=r"n_layer=2.5 must be a positive integer"):
        GPTConfig(n_layer=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tie_embeddings='false' must be True or False"):
        GPTConfig(tie_embeddings="false")  # type: ignore[arg-type]
