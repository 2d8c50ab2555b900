"""SamplingParams: its integers fit what the engine link and torch carry; checked once, by
``validate`` (which check_request runs), not on construction."""

from __future__ import annotations

import pytest

from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import INT64_MAX, INT64_MIN, SamplingParams


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"max_tokens": INT64_MAX + 1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": INT64_MAX + 1}, "top_k"),
        ({"top_k": INT64_MIN - 1}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [1, INT64_MAX + 1]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_integers_out_of_range_are_refused(kw, param):
    params = SamplingParams(**kw)  # built as given: copies and decodes check nothing
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert info.value.param == param


def test_the_edges_are_accepted():
    p = SamplingParams(
        max_tokens=INT64_MAX, top_k=INT64_MIN, seed=2**64 - 1, stop_token_ids=[INT64_MAX]
    )
    p.validate()
    assert (p.max_tokens, p.top_k, p.seed) == (INT64_MAX, INT64_MIN, 2**64 - 1)
    SamplingParams(seed=INT64_MIN).validate()


def test_one_stop_string_is_a_list_of_one():
    assert SamplingParams(stop_strings="###").stop_strings == ["###"]
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_strings=["ok", ""]).validate()
    assert info.value.param == "stop"
